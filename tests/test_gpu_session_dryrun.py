"""The GPU session's CPU dry run (`benchmarks/gpu_session.py --device cpu --quick`): every stage's code runs to the end
and writes its rows with values that follow from what was timed (ratios, TFLOP/s, tokens/s), bf16 errors of a right
kernel, and "not run (no CUDA)" where only a GPU can answer; its clock ends the run by itself; the raw varlen FA2
baseline's aten calls run on meta tensors as they will on CUDA.

GPU_SESSION_SCRIPT=path runs these tests against another copy of the script (e.g. a broken one, to see them fail).
"""
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import documented
import pytest
import torch
from test_gpu_check_dryrun import table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.environ.get("GPU_SESSION_SCRIPT", os.path.join(ROOT, "benchmarks", "gpu_session.py"))
NO_CUDA = "not run (no CUDA)"
DOCUMENTED = documented.command("python3 benchmarks/gpu_session.py --device cpu --quick")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def run(tmp_path, *extra, timeout=300):
    """The documented dry run as written (docs/performance.md), its report where the script says it wrote it; with
    `extra` flags, the same run given them and an --out in tmp_path."""
    log = tmp_path / "stdout.txt"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TMPDIR=str(tmp_path),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.pop("TRITON_INTERPRET", None)  # the dry run's own default: the Triton side "not run (no CUDA)"
    if extra:
        command = [sys.executable, SCRIPT, "--device", "cpu", "--quick", "--out", str(tmp_path / "gpu_session.md"),
                   *extra]
    else:
        command = ["bash", "-c", DOCUMENTED.replace("benchmarks/gpu_session.py", shlex.quote(SCRIPT))]
    with open(log, "w") as f:  # a file, not a pipe: an undrained pipe can block the child
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    said = log.read_text()
    last = said.strip().splitlines()[-1] if said.strip() else ""
    out = Path(last[len("report: "):]) if last.startswith("report: ") else tmp_path / "gpu_session.md"
    return done.returncode, out, said


def section(text, stage):
    """The text of one stage's section (## S<n> ...) up to the next."""
    return re.search(rf"^## {stage} .*?(?=^## S|\Z)", text, re.M | re.S).group(0)


def num(cell):
    return float(cell.rstrip("%"))


def test_gpu_session_cpu_dry_run(tmp_path):
    from gpu_session_stages import causal_flops

    t0 = time.monotonic()
    code, out, log = run(tmp_path)
    assert code == 0, log[-3000:]
    assert log.strip().splitlines()[-1] == f"report: {out}" and tmp_path in out.parents
    text = out.read_text()
    first = text.splitlines()[0]
    assert first.startswith("# gpu_session: CPU dry run (") and f"torch {torch.__version__}" in first, first
    assert re.search(r"^total \d+ s$", text, re.M) and "in progress" not in text
    assert "failed" not in text and not re.search(r"^skipped S", text, re.M) and "FAIL" not in text, text
    assert not Path(f"{out}.tracebacks.txt").exists()
    assert [ln for ln in text.splitlines() if ln.startswith("## ")] == [
        "## S1 kernels", "## S2 CUDA tests", "## S3 1B Llama", "## S4 flex", "## S5 long-context masks"]

    # S1: per causal T, raw SDPA-flash = 1.000, the ops on the automatic backend measured against it, the forced
    # cuda_flash rows not run; the right-padded block has no raw varlen baseline on the CPU, so no ratios.
    _, rows = table(section(text, "S1"), "T")
    B = {64: 4, 128: 2}
    # Each block ends with softmax without the non-finite rule: the rule's cost (issue 42, item 4) is softmax (auto)
    # against it and against raw.
    off = "softmax (auto), isolation off"
    assert [(r["T"], r["mask"], r["row"]) for r in rows] == [
        *((str(T), "causal", f"{v} (cuda_flash)") for T in (64,) for v in ("softmax", "sink", "affine")),
        *((str(T), "causal", r) for T in (64,) for r in ("raw SDPA-flash", "softmax (auto)", "sink (auto)",
                                                           "affine (auto)", off)),
        *((str(T), "causal", f"{v} (cuda_flash)") for T in (128,) for v in ("softmax", "sink", "affine")),
        *((str(T), "causal", r) for T in (128,) for r in ("raw SDPA-flash", "softmax (auto)", "sink (auto)",
                                                            "affine (auto)", off)),
        ("64", "right-padded", "raw varlen FA2"),
        *(("64", "right-padded", f"{v} (auto)") for v in ("softmax", "sink", "affine")), ("64", "right-padded", off)]
    for r in rows:
        T = int(r["T"])
        assert r["B"] == str(B[T]), r
        if r["row"].endswith("(cuda_flash)") or r["row"] == "raw varlen FA2":
            assert r["backend"] == NO_CUDA and all(v == "—" for k, v in r.items()
                                                   if k not in ("T", "B", "mask", "row", "backend")), r
            continue
        assert r["compile s (fwd / fwd+bwd)"] == "—", r
        assert 0 < num(r["err out vs float64"]) < 0.05, r  # bf16 rounding, not a wrong mask or a lost term
        assert num(r["peak MiB fwd+bwd"]) >= 0, r
        if r["mask"] == "right-padded":
            lengths = [T - (b % 4 + 1) * T // 8 for b in range(B[T])]
            assert r["fwd / raw"] == r["fwd+bwd / raw"] == NO_CUDA and r["backend"] != "—", r
        else:
            lengths = [T] * B[T]
            assert r["backend"] == "sdpa (FLASH only)" if r["row"] == "raw SDPA-flash" else r["backend"] in (
                "sdpa", "cpu_flash", "exact"), r
            assert num(r["fwd / raw"]) > 0 and num(r["fwd+bwd / raw"]) > 0, r
            if r["row"] == "raw SDPA-flash":
                assert r["fwd / raw"] == r["fwd+bwd / raw"] == "1.000", r
        for name, factor in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            ms = num(r[f"{name} ms"])
            assert ms > 0, r  # TFLOP/s is the causal FLOP count over that time (3 significant digits)
            want = causal_flops(lengths, 4, 32) * factor / (ms / 1e3) / 1e12
            assert num(r[f"{name} TFLOP/s"]) == pytest.approx(want, rel=0.01), (r, want)

    # S2: the cuda-marked tests (skipped here, none deselected by error), then the Triton epilogue table.
    s2 = section(text, "S2")
    assert re.search(r"CUDA tests \(`pytest -m cuda tests/test_backends_cuda\.py`, exit 0\): \d+ skipped", s2), s2
    _, rows = table(s2, "dtype")
    assert [(r["dtype"], r["gate"]) for r in rows] == [(d, g) for d in ("bfloat16", "float32") for g in (
        "elementwise (B, Hq, T, D)", "headwise (B, Hq, T, 1)", "none")]
    for r in rows:
        assert r["out"] == r["rel triton vs float64"] == NO_CUDA, r
        assert 0 < num(r["rel eager vs float64"]) < (1e-2 if r["dtype"] == "bfloat16" else 1e-5), r

    # S3: eager then compiled, each variant; the compiled loss and gradient norms equal eager's (float32, aot_eager).
    _, rows = table(section(text, "S3"), "mode")
    assert [(r["mode"], r["variant"]) for r in rows] == [
        (m, v) for m in ("eager", "compiled (per block)") for v in ("unconverted", "affine", "sink")]
    losses = {}
    for r in rows:
        secs = num(r["step ms"]) / 1e3
        assert secs > 0 and num(r["tokens/s"]) == pytest.approx(2 * 32 / secs, rel=0.01, abs=1), r
        assert r["MFU"] == NO_CUDA and num(r["peak MiB (step)"]) >= 0, r
        assert r["backends"] == "transformers" if r["variant"] == "unconverted" else r["backends"] not in ("", "—")
        assert r["step / unconverted"] == "1.000" if r["variant"] == "unconverted" else num(r["step / unconverted"]) > 0
        assert 1 < num(r["loss"]) < 20, r  # cross-entropy of random weights over tiny-llama's vocabulary
        losses.setdefault(r["variant"], []).append(r["loss"])
        if r["mode"] == "eager":
            assert r["check"] == r["compile s"] == r["loss compiled / eager"] == "—", r
            continue
        secs, graphs = re.fullmatch(r"(\d+\.\d) \((\d+) graphs\)", r["compile s"]).groups()
        assert r["check"] == "ok" and float(secs) > 0 and int(graphs) >= 1, r
        assert num(r["loss compiled / eager"]) == pytest.approx(1, abs=1e-4), r
        for k in ("q_proj", "v_proj", "alpha_proj"):
            cell = r[f"{k} grad norm c/e"]
            if k == "alpha_proj" and r["variant"] != "affine":
                assert cell == "—", r
            else:
                assert num(cell) == pytest.approx(1, abs=1e-3), r
    assert all(a == b for a, b in losses.values()), losses

    # S4: flex needs CUDA; the four flex tests exist by node id (skipped here, not "not found").
    s4 = section(text, "S4")
    assert re.search(r"test_backends_flex\.py::test_cuda_flex_against_float64_reference\[sink-softcap\].*exit 0\): "
                     r"4 skipped", s4), s4
    _, rows = table(s4, "T")
    assert [(r["row"], r["backend"]) for r in rows] == [("softmax (flex)", NO_CUDA), ("sink (flex)", NO_CUDA)]

    # S5: gpu_check's configuration groups at the long T, each variant against the same kernel's softmax.
    _, rows = table(section(text, "S5"), "T")
    assert [(r["mask"], r["variant"]) for r in rows] == [
        (m, v) for m in ("padded", "documents", "window") for v in ("softmax", "sink", "affine")]
    for r in rows:
        assert r["T"] == "128" and num(r["fwd ms"]) > 0 and 0 < num(r["err out"]) < 0.05, r
        assert r["fwd / softmax"] == "1.000" or r["variant"] != "softmax", r
    assert time.monotonic() - t0 < 240


@pytest.mark.slow  # ~25 s: the run's clock, cut on purpose
def test_gpu_session_clock_ends_the_run(tmp_path):
    """A group that hangs is cut at the run's deadline, every later job is skipped with the time it would have
    needed, and the script ends by itself shortly after the deadline with exit 0."""
    t0 = time.monotonic()
    code, out, log = run(tmp_path, "--deadline-s", "20", "--only", "S1", "S3", "--inject-failure=hang:S1-T64-causal",
                         timeout=120)
    took = time.monotonic() - t0
    assert code == 0, log[-3000:]
    assert took < 20 + 25, took  # the deadline, the worker's stack dump and kill, the report
    text = out.read_text()
    _, rows = table(section(text, "S1"), "T")
    assert len(rows) == 1 and (rows[0]["T"], rows[0]["mask"], rows[0]["row"]) == ("64", "causal", "all"), rows
    assert re.fullmatch(r"failed: timed out after \d+ s \(the run's clock\) \(traceback #1 in "
                        r"gpu_session\.md\.tracebacks\.txt\)", rows[0]["backend"]), rows[0]
    for job, stage in (("S1-T128-causal", "S1"), ("S1-T64-padded", "S1"), ("S3-llama", "S3")):
        assert re.search(rf"^skipped {job}: \d+ s left on the clock, it needs at least \d+ s$",
                         section(text, stage), re.M), (job, text)
    assert re.search(r"^total \d+ s$", text, re.M)


def test_raw_varlen_flash_runs_the_aten_kernels_on_meta():
    """The raw varlen FA2 baseline's calls (the forward with cumulative lengths, then its backward), as they will
    run on CUDA: arguments accepted by this torch's schema, shapes (total, H, D) out, GQA gradients per key head."""
    from gpu_session_stages import raw_varlen_flash, varlen_pack

    lengths, Hq, Hkv, D = [40, 24, 7], 8, 2, 64
    q, k, v = (torch.empty(len(lengths), h, 40, D, device="meta", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    q, k, v = (varlen_pack(x, lengths) for x in (q, k, v))
    assert q.shape == (71, Hq, D) and k.shape == (71, Hkv, D)
    out = raw_varlen_flash(q, k, v, lengths, backward=False)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    dq, dk, dv = raw_varlen_flash(q, k, v, lengths, backward=True)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
