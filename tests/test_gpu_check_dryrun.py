"""The GPU check's CPU dry run (`benchmarks/gpu_check.py --device cpu --quick`) runs to the end and prints its table:
every row, every column, errors that a bf16 kernel would have; so the script runs the first time on a lent GPU."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_cpu_dry_run(tmp_path):
    out = tmp_path / "report.md"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = tmp_path / "log.txt"
    with open(log, "w") as f:  # a file, not a pipe: an undrained pipe can block the child
        done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--device", "cpu",
                               "--quick", "--out", str(out)], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=300)
    assert done.returncode == 0, log.read_text()[-3000:]
    text = out.read_text()
    assert "CUDA tests (`pytest -m cuda tests/test_backends_cuda.py`, exit 0)" in text and "skipped" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    header, rows = lines[0].strip("|").split("|"), [ln.strip("|").split("|") for ln in lines[2:]]
    assert len(header) == 16 and all(len(r) == 16 for r in rows)
    cells = [dict(zip((h.strip() for h in header), (c.strip() for c in r))) for r in rows]
    masks = {"causal", "padded", "documents", "window"}
    assert {c["mask"] for c in cells if not c["variant"].startswith("affine (epilogue")} == masks
    for mask in masks:
        assert {c["variant"] for c in cells if c["mask"] == mask} >= {"softmax", "sink", "affine"}
    # Timing-only rows of the fused epilogue against the kernel alone (no memory or error columns: "—").
    epilogue = [c for c in cells if c["variant"].startswith("affine (epilogue")]
    assert epilogue and all(c["peak MiB fwd+bwd"] == "—" and float(c["fwd+bwd / softmax"]) > 0 for c in epilogue)
    for c in cells:
        if c in epilogue:
            continue
        assert float(c["fwd ms"]) > 0 and float(c["fwd+bwd / softmax"]) > 0 and float(c["peak MiB fwd+bwd"]) >= 0
        if c["variant"] in ("softmax", "sink", "affine"):
            assert c["fwd / softmax"] == "1.000" or c["variant"] != "softmax"
            errs = [c[k] for k in ("err out", "err dq", "err dk", "err dv")]
            errs += [c["err dsinks/dalpha"]] if c["variant"] != "softmax" else []
            assert all(0 < float(e) < 0.05 for e in errs), c  # bf16 rounding, not a wrong mask or a lost term
