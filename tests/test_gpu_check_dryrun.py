"""The GPU check's CPU dry run (`benchmarks/gpu_check.py --device cpu --quick`, the wider sweep beside
benchmarks/gpu_session.py): it runs to the end and writes its tables (every row, every column, errors that a bf16
kernel would have, which SDPA kernel ran), so the script runs the first time on a lent GPU; and it loses nothing when a
step fails: a failing row or group, a killed or hung group, a hung CUDA test and a kill of the script itself each leave
every finished row on disk and say what happened. Also: the FA3 column decided by importing its package (torch lists
FA3 without it), and no import circle among the GPU scripts' modules.

GPU_CHECK_SCRIPT=path runs these tests against another copy of the script (e.g. an older revision, to see them fail).
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.environ.get("GPU_CHECK_SCRIPT", os.path.join(ROOT, "benchmarks", "gpu_check.py"))


def env():
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.pop("TRITON_INTERPRET", None)  # the dry run's own default: the Triton side "not run (no CUDA)"
    return e


def command(out, *extra):
    return [sys.executable, SCRIPT, "--device", "cpu", "--quick", "--out", str(out), *extra]


def run(tmp_path, *extra):
    out, log = tmp_path / "report.md", tmp_path / "stdout.txt"
    with open(log, "w") as f:  # a file, not a pipe: an undrained pipe can block the child
        done = subprocess.run(command(out, *extra), cwd=ROOT, env=env(), stdout=f, stderr=subprocess.STDOUT,
                              timeout=300)
    return done.returncode, out, log.read_text()


def table(text, first):
    """The rows of the markdown table whose header starts with column `first`, as dicts."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first} |"))
    block = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        block.append([c.strip() for c in ln.strip().strip("|").split("|")])
    header = block[0]
    assert all(len(r) == len(header) for r in block), block
    return header, [dict(zip(header, r)) for r in block[2:]]


def traceback_entry(tb_text, cell):
    """The entry of the tracebacks file that a `failed: ... (traceback #N in ...)` cell points to."""
    n = re.search(r"traceback #(\d+) in report\.md\.tracebacks\.txt", cell).group(1)
    return tb_text.split(f"=== #{n} ")[1].split("\n=== #")[0]


@pytest.mark.slow  # ~45 s; gpu_session's dry run (the default suite) runs the shared worker code every commit
def test_gpu_check_cpu_dry_run(tmp_path):
    code, out, log = run(tmp_path)
    assert code == 0, log[-3000:]
    assert log.strip().splitlines()[-1] == f"report: {out}"  # the path printed last
    text = out.read_text()
    assert ("CUDA tests (`pytest -m cuda tests/test_backends_cuda.py tests/test_backends_flex.py`, exit 0)" in text
            and "skipped" in text)
    assert "deselected" in (tmp_path / "report.md.pytest.txt").read_text()  # pytest's own output, kept
    assert re.search(r"^total \d+ s$", text, re.M) and "in progress" not in text and "failed" not in text
    assert not (tmp_path / "report.md.tracebacks.txt").exists()
    header, cells = table(text, "T")
    assert len(header) == 17 and header[6] == "sdpa kernel"
    masks = {"causal", "padded", "documents", "window"}
    assert {c["mask"] for c in cells if not c["variant"].startswith("affine (epilogue")} == masks
    for mask in masks:
        assert {c["variant"] for c in cells if c["mask"] == mask} >= {"softmax", "sink", "affine"}
    # SDPA's own choice, profiled, on every row the sdpa backend serves (on CPU its flash kernel); "—" elsewhere.
    assert [c["backend"] for c in cells if c["variant"] == "softmax (auto)"] == ["sdpa"]
    for c in cells:
        assert c["sdpa kernel"] == ("flash (cpu)" if c["backend"] == "sdpa" else "—"), c
    # Timing-only rows of the fused epilogue against the kernel alone (no memory or error columns: "—").
    epilogue = {c["variant"]: c for c in cells if c["variant"].startswith("affine (epilogue")}
    assert set(epilogue) == {"affine (epilogue eager)", "affine (epilogue triton)"}
    eager = epilogue["affine (epilogue eager)"]
    assert eager["peak MiB fwd+bwd"] == "—" and float(eager["fwd+bwd / softmax"]) > 0
    assert epilogue["affine (epilogue triton)"]["backend"] == "not run (no CUDA)"
    for c in cells:
        if c["variant"] in epilogue:
            continue
        assert float(c["fwd ms"]) > 0 and float(c["fwd+bwd / softmax"]) > 0 and float(c["peak MiB fwd+bwd"]) >= 0
        if c["variant"] in ("softmax", "sink", "affine"):
            assert c["fwd / softmax"] == "1.000" or c["variant"] != "softmax"
            errs = [c[k] for k in ("err out", "err dq", "err dk", "err dv")]
            errs += [c["err dsinks/dalpha"]] if c["variant"] != "softmax" else []
            assert all(0 < float(e) < 0.05 for e in errs), c  # bf16 rounding, not a wrong mask or a lost term
    # The epilogue table: per dtype and gate, triton "not run (no CUDA)", the eager one at its dtype's rounding.
    header, rows = table(text, "dtype")
    assert [(r["dtype"], r["gate"]) for r in rows] == [(d, g) for d in ("bfloat16", "float32") for g in (
        "elementwise (B, Hq, T, D)", "headwise (B, Hq, T, 1)", "none")]
    for r in rows:
        assert r["out"] == r["d alpha"] == r["rel triton vs float64"] == "not run (no CUDA)", r
        assert r["d gate"] == ("—" if r["gate"] == "none" else "not run (no CUDA)"), r
        assert 0 < float(r["rel eager vs float64"]) < (1e-2 if r["dtype"] == "bfloat16" else 1e-5), r


@pytest.mark.slow  # the script's failure handling (~15 s each): the slow suite
def test_gpu_check_keeps_every_row_through_failures_and_a_kill(tmp_path):
    """One row raising, the worker SIGKILLed later in the same group, a group raising, then the script itself killed
    while a group hangs: each finished row is on disk as soon as it is finished, each failure is a `failed:` row
    pointing to its traceback, and the rows around them are measured as in a clean run."""
    out = tmp_path / "report.md"
    inject = ["raise:*-causal:sink", "kill:*-causal:softmax (auto)", "raise:*-padded", "hang:*-window:sink"]
    cmd = command(out, "--tests", "--only", "T96-4x2-causal", "T96-4x2-padded", "T96-4x2-window",
                  *(f"--inject-failure={s}" for s in inject))
    counts, text = [], ""
    with open(tmp_path / "stdout.txt", "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group: the kill below takes the workers too
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and proc.poll() is None:
                text = out.read_text() if out.exists() else ""
                running = re.search(r"^_in progress: group (\S+)", text, re.M)
                counts.append((sum(ln.startswith("| 96 |") for ln in text.splitlines()), running and running[1]))
                if "| window | softmax |" in text:
                    break
                time.sleep(0.1)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended by itself (then the assertions below say why)
                pass
            proc.wait()
    assert "| window | softmax |" in text, (tmp_path / "stdout.txt").read_text()[-3000:]
    # Rows reached the disk one by one, never taken back (an atomic rewrite after each row): some while their own
    # group was still running, not only once it had ended.
    assert [n for n, _ in counts] == sorted(n for n, _ in counts), counts
    assert any(0 < n < 4 and group == "T96-4x2-causal" for n, group in counts), counts
    text = out.read_text()
    assert re.search(r"^_in progress: group T96-4x2-window \(worker w\d+\) since \d+ s", text, re.M), text
    _, cells = table(text, "T")
    rows = {(c["mask"], c["variant"]): c for c in cells}
    assert list(rows) == [("causal", "softmax"), ("causal", "sink"), ("causal", "affine"),
                          ("causal", "(rest of group)"), ("padded", "all"), ("window", "softmax")]
    tb = (tmp_path / "report.md.tracebacks.txt").read_text()
    for key, message in ((("causal", "sink"), "RuntimeError: injected failure (raise:*-causal:sink)"),
                         (("causal", "(rest of group)"), "the worker exited with code -9 (SIGKILL)"),
                         (("padded", "all"), "RuntimeError: injected failure (raise:*-padded)")):
        cell = rows[key]["backend"]
        assert cell.startswith(f"failed: {message} (traceback #") and cell.endswith(" in report.md.tracebacks.txt)")
        assert all(v == "—" for k, v in rows[key].items() if k not in ("T", "B", "Hq/Hkv", "mask", "variant",
                                                                          "backend")), rows[key]
        entry = traceback_entry(tb, cell)
        if key[1] != "(rest of group)":  # the full Python traceback, down to the line that raised
            assert "Traceback (most recent call last)" in entry and "in inject" in entry and entry.rstrip().endswith(
                message), entry
        else:  # what the dead worker left: its (empty) stack dump and its output
            assert entry.startswith("T96-4x2-causal: the worker exited with code -9") and "--- output" in entry
    for key in (("causal", "softmax"), ("causal", "affine"), ("window", "softmax")):
        assert float(rows[key]["fwd ms"]) > 0 and float(rows[key]["peak MiB fwd+bwd"]) >= 0, rows[key]
        assert 0 < float(rows[key]["err out"]) < 0.05, rows[key]
    assert rows[("causal", "affine")]["sdpa kernel"] == "flash (cpu)"


@pytest.mark.slow  # the script's failure handling (~15 s each): the slow suite
def test_gpu_check_times_out_hung_steps(tmp_path):
    """A hung CUDA test and a hung group are cut at their timeouts; the tests' partial output is kept, the group is
    a `failed: timed out` row whose traceback entry is the hung worker's stack dump, and the run still exits 0."""
    tests = tmp_path / "test_hangs.py"
    tests.write_text("import time\nimport pytest\n\n\n@pytest.mark.cuda\ndef test_finishes():\n    pass\n\n\n"
                     "@pytest.mark.cuda\ndef test_hangs():\n    time.sleep(600)\n")
    t0 = time.monotonic()
    code, out, log = run(tmp_path, "--tests", str(tests), "--tests-timeout-s", "10", "--only", "epilogue-numerics",
                         "--inject-failure=hang:epilogue-numerics", "--group-timeout-s", "3")
    assert code == 0, log[-3000:]
    assert time.monotonic() - t0 < 120
    text = out.read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("CUDA tests"))
    assert "timed out after 10 s, partial output in report.md.pytest.txt (1 passed, 0 failed" in line, line
    assert "it was running" in line and "test_hangs" in line, line
    partial = (tmp_path / "report.md.pytest.txt").read_text()
    assert re.search(r"test_finishes PASSED", partial) and "KeyboardInterrupt" in partial, partial
    _, rows = table(text, "dtype")
    assert len(rows) == 1 and rows[0]["dtype"] == "all", rows
    cell = rows[0]["out"]
    assert re.fullmatch(r"failed: timed out after \d+ s \(traceback #1 in report\.md\.tracebacks\.txt\)", cell), cell
    assert 3 <= int(re.search(r"after (\d+) s", cell).group(1)) < 10
    entry = traceback_entry((tmp_path / "report.md.tracebacks.txt").read_text(), cell)
    stack = entry.split("--- stack dump")[1].split("--- output")[0]
    assert "in inject" in stack and "in epilogue_numerics" in stack, entry  # where it hung, from faulthandler
    events = (tmp_path / "report.md.log").read_text()
    assert "group epilogue-numerics: timeout after" in events  # the event log says it too


@pytest.mark.slow
def test_gpu_check_model_rows_dry_run(tmp_path):
    """The model training-step rows (two of the model-* groups): eager and compiled (fullgraph) steps of every variant
    against the unconverted model, each row naming the backends that served it; FA3 "not run (no CUDA)" on the CPU."""
    code, out, log = run(tmp_path, "--tests", "--only", "model-mistral-eager", "model-llama-compiled")
    assert code == 0, log[-3000:]
    text = out.read_text()
    assert "failed" not in text, text
    _, rows = table(text, "model")
    assert {(r["model"], r["mode"], r["variant"]) for r in rows} == {
        (m, mode, v) for m, mode in (("mistral", "eager"), ("llama", "compiled"))
        for v in ("unconverted", "softmax", "sink", "affine")}
    for r in rows:
        assert float(r["step ms"]) > 0 and float(r["step / unconverted"]) > 0, r
        assert r["backends"] == ("transformers" if r["variant"] == "unconverted" else "cpu_flash"), r
        assert r["FA3 step / unconverted"] == "not run (no CUDA)", r


class _Refuse:
    """A meta-path finder under which `flash_attn_interface` cannot be imported (as on the lent GPU machine)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "flash_attn_interface":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def test_fa3_column_without_its_package_costs_the_column_not_the_rows(monkeypatch):
    """torch lists FA3 whether or not `flash_attn_interface` is installed, and activating it then raises: the model
    rows' FA3 measurement must say "not available (...)" and leave FA2 in place, never raise out of the group."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from gpu_check_models import fa3_times

    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Refuse(), *sys.meta_path])
    attention = torch.nn.attention
    if hasattr(attention, "list_flash_attention_impls"):
        assert "FA3" in attention.list_flash_attention_impls()  # listed, yet not importable: the trap
    measured = []
    times, note = fa3_times(torch.device("cuda"), lambda: measured.append(1) or {"unconverted": (1.0, 1.0)})
    assert times is None and measured == [], (times, note)
    assert note.startswith("not available (ModuleNotFoundError: No module named 'flash_attn_interface'"), note
    if hasattr(attention, "current_flash_attention_impl"):
        assert attention.current_flash_attention_impl() in (None, "FA2"), attention.current_flash_attention_impl()
    assert fa3_times(torch.device("cpu"), lambda: measured.append(1)) == (None, "not run (no CUDA)")


def test_gpu_scripts_import_no_module_back():
    """benchmarks' GPU modules (gpu_*.py): no import circle, counting imports inside functions too; the worker
    machinery imports none of the scripts or job modules that use it."""
    import ast

    folder = os.path.join(ROOT, "benchmarks")
    names = {f[:-3] for f in os.listdir(folder) if f.startswith("gpu_") and f.endswith(".py")}
    graph = {}
    for name in names:
        tree = ast.parse(open(os.path.join(folder, name + ".py")).read())
        found = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        found |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        graph[name] = sorted(found & names)
    assert graph["gpu_check_worker"] == [], graph

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph[start])

    assert [n for n in sorted(names) if reaches(n, n)] == [], graph
