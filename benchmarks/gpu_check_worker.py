"""The machinery of the GPU scripts (benchmarks/gpu_session.py, benchmarks/gpu_check.py): one group of measurements
in one fresh Python process, and the parent's side that runs, times out and records those processes.

The parent starts `<script> --worker BASE --device ... [--quick]`; this process imports torch (and, on a GPU,
creates its CUDA context) while the previous group still runs, appends {"ready": ...} to BASE.jsonl, then reads one
job (a JSON line) from stdin, runs it and appends every finished row as a JSON line (flushed and fsynced, so a kill
keeps it). Python-level failures become {"failed": ...} records with the full traceback; fatal signals and the
parent's SIGUSR1 (sent before it kills a timed-out group) dump every thread's stack to BASE.stack.txt.
A sticky CUDA error (device-side assert, illegal address) ends this process only: the parent starts a fresh one
for the next group.

The parent's side of this protocol (Worker, run_group, and the event log, tracebacks file and pytest runner both
scripts write) lives here too, so both ends of it are read together; at import time this module needs only the
standard library (torch is imported inside the functions that use it). It imports neither script nor their job
modules: each script hands worker_main its own job table.
"""
from __future__ import annotations

import faulthandler
import fnmatch
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class Records:
    """Append-only JSON lines, each on disk before the next measurement starts."""

    def __init__(self, path: str):
        self.f = open(path, "a", encoding="utf-8")

    def put(self, **record) -> None:
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def failure(self, table: str, key: dict, exc: BaseException) -> None:
        self.put(failed={"table": table, "key": key, "type": type(exc).__name__, "message": str(exc),
                         "traceback": "".join(traceback.format_exception(exc))})


def finish(rec: Records, code: int) -> None:
    """Exit without interpreter teardown: after a sticky CUDA error the CUDA destructors can hang or abort."""
    rec.put(done=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cuda_usable(device) -> bool:
    """False once the context holds a sticky error (every later CUDA call would fail with it)."""
    import torch

    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001  (any error here means the context is gone)
        return False


def optional_kernel(device, modules: tuple[str, ...]) -> str | None:
    """None if an optional kernel can run here, else the words for its cells: "not run (no CUDA)", or "not
    available (...)" when one of the modules it needs fails to import. Availability is what imports, never what a
    registry lists (torch lists FA3 and FA4 whether or not their packages are installed)."""
    import importlib

    if device.type != "cuda":
        return "not run (no CUDA)"
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001  (absent or broken: either way the kernel cannot run)
            return f"not available ({type(e).__name__}: {e})"
    return None


def guarded(rec: Records, device, table: str, key: dict, rows) -> None:
    """Record each row that `rows()` yields, or the failure: one broken row must not cost the others."""
    try:
        for row in rows():
            rec.put(table=table, row=row)
    except Exception as e:  # noqa: BLE001  (recorded with its traceback, never hidden)
        rec.failure(table, key, e)
        if not cuda_usable(device):
            rec.put(fatal=f"the CUDA context is unusable after {type(e).__name__}; the rest of this group not run")
            finish(rec, 3)


def inject(args, gid: str, variant: str | None, device) -> None:
    """Test hook (hidden flag --inject-failure KIND:GROUP[:VARIANT], GROUP an fnmatch pattern of group ids): fail on
    purpose at the start of a group (no VARIANT) or of one row. KIND: raise, hang, kill (SIGKILL itself), sticky (a
    device-side assert on CUDA; an IndexError on CPU)."""
    for spec in args.inject_failure:
        kind, _, rest = spec.partition(":")
        pattern, _, var = rest.partition(":")
        if not fnmatch.fnmatchcase(gid, pattern) or (var or None) != variant:
            continue
        if kind == "raise":
            raise RuntimeError(f"injected failure ({spec})")
        if kind == "hang":
            time.sleep(3600)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "sticky":
            import torch

            x = torch.zeros(4, device=device)
            x[torch.tensor([1 << 30], device=device)] = 1.0  # IndexError on CPU; asynchronous on CUDA
            torch.cuda.synchronize()
        raise ValueError(f"--inject-failure {spec!r}: unknown kind, or it failed to fail")


# --- the parent's side (gpu_check.py runs every group through these) ---

STARTUP_S = 180.0  # a cold torch import plus a CUDA context: seconds, not minutes


def parse_record(line: bytes) -> dict:
    try:
        return json.loads(line)
    except ValueError:  # never expected (whole lines, fsynced); a bad one must not end the run
        return {"note": f"unreadable record: {line[:200]!r}"}


class Worker:
    """The parent's handle on one fresh worker process (one group): its records in <name>.jsonl, its stdout and
    stderr in <name>.out, its stack dumps in <name>.stack.txt."""

    count = 0

    def __init__(self, cmd: list[str], folder: str, env: dict):
        Worker.count += 1
        self.name = f"w{Worker.count:02d}"
        self.base = os.path.join(folder, self.name)
        open(self.base + ".jsonl", "w").close()
        with open(self.base + ".out", "w") as out:
            self.proc = subprocess.Popen(cmd + ["--worker", self.base], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                         stdout=out, stderr=subprocess.STDOUT, text=True)
        self.spawned, self.offset, self.ready, self.pending = time.monotonic(), 0, None, []

    def poll(self) -> list[dict]:
        """The records completed since the last call (a line still being written waits for the next)."""
        with open(self.base + ".jsonl", "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        chunk = chunk[:chunk.rfind(b"\n") + 1]
        self.offset += len(chunk)
        recs = [parse_record(ln) for ln in chunk.splitlines() if ln.strip()]
        for r in recs:
            self.ready = r["ready"] if "ready" in r else self.ready
        return [r for r in recs if "ready" not in r]

    def wait_ready(self, deadline: float) -> dict | None:
        """Its ready record (versions, whether CUDA is there), or None if it died or the deadline passed first."""
        pending = []
        while self.ready is None and self.proc.poll() is None and time.monotonic() < deadline:
            pending += self.poll()
            time.sleep(0.1)
        pending += self.poll()
        self.pending = pending
        return self.ready

    def send(self, job: dict) -> bool:
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.close()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def stop(self) -> None:
        """Every thread's stack into <name>.stack.txt (faulthandler on SIGUSR1), then kill."""
        if self.proc.poll() is None and hasattr(signal, "SIGUSR1"):
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def dismiss(self) -> None:
        """A started worker with no job left: end of input is its signal to exit."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def evidence(self) -> str:
        """The stack dump and the tail of its output, for the tracebacks file."""
        parts = []
        for suffix, what in ((".stack.txt", "stack dump"), (".out", "output (tail)")):
            try:
                text = open(self.base + suffix, errors="replace").read()[-6000:]
            except OSError:
                text = ""
            parts.append(f"--- {what} ({self.name}{suffix}) ---\n{text.strip() or '(empty)'}")
        return "\n".join(parts)


def outcome_words(outcome: str, secs: float) -> str:
    """run_group's outcome other than "done", in the words of a `failed: ...` cell."""
    if outcome in ("timeout", "deadline"):
        return f"timed out after {secs:.0f} s" + (" (the run's clock)" if outcome == "deadline" else "")
    return outcome[len("died: "):]


def run_group(w: Worker, job: dict, limit_s: float, deadline: float, handle) -> tuple[str, float]:
    """Send job to w and pass its records to handle until it is done, dies, or runs past limit_s (from its start
    record) or the deadline. Returns ("done" | "timeout" | "deadline" | "died: ...", seconds since the job started)."""
    started, sent = None, time.monotonic()
    for rec in w.pending:
        handle(rec)
    w.send(job)  # a worker that already died fails to read it: found dead below
    while True:
        code = w.proc.poll()  # before reading: every record of an exited worker is then on disk
        for rec in w.poll():
            if "start" in rec:
                started = time.monotonic()
            elif "done" in rec:
                try:
                    w.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                return "done", time.monotonic() - (started or sent)
            else:
                handle(rec)
        if code is not None:
            sig = f" ({signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() else ""
            return f"died: the worker exited with code {code}{sig}", time.monotonic() - (started or sent)
        now = time.monotonic()
        # Not started yet: a worker still importing has STARTUP_S from its spawn; one that was ready (prefetched,
        # maybe idle for minutes while a long group ran) reads the job at once.
        limit = started + limit_s if started else sent + 60 if w.ready is not None else w.spawned + STARTUP_S
        if now > min(limit, deadline):
            w.stop()
            for rec in w.poll():
                if "start" not in rec and "done" not in rec:
                    handle(rec)
            return ("timeout" if limit <= deadline else "deadline"), now - (started or sent)
        time.sleep(0.1)


def run_to_file(cmd: list[str], path: str, timeout: float, env: dict, interrupt=signal.SIGINT) -> tuple[int, bool]:
    """Run cmd with its output appended to `path` as it comes (a file, not a pipe: a timeout keeps it); past
    `timeout` send `interrupt` (pytest then prints its summary), then kill. Returns (exit code, timed out)."""
    with open(path, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            proc.send_signal(interrupt)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return proc.returncode, True


def install(log, env: dict, timeout: float = 90.0) -> str:
    """pip install --no-deps -e . (torch, transformers and triton are already on the lent machine). Offline, build
    isolation cannot fetch setuptools, so the installed one (and no index) is tried first; pip has no overall
    timeout of its own, hence the subprocess's. Returns one line for the report."""
    base = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--disable-pip-version-check",
            "--timeout", "10", "--retries", "0"]
    for extra in (["--no-build-isolation", "--no-index"], []):
        cmd = base + extra + ["-e", ROOT]
        code, timed_out = run_to_file(cmd, log.path, timeout, env)
        if code == 0 and not timed_out:
            return f"installed: `pip install {' '.join(cmd[4:-2])} -e .`"
        log(f"install attempt {'timed out' if timed_out else f'exit {code}'}")
    return (f"install failed ({'timed out' if timed_out else f'exit {code}'}; see {os.path.basename(log.path)}); "
            "running from the source tree instead")


def run_cuda_tests(paths: list[str], out_path: str, timeout: float, env: dict) -> str:
    """The tests marked `cuda` (they skip without a GPU), output streamed to out_path; pytest's summary line."""
    # One process (the GPU is one device), and no project addopts: they name pytest-xdist, which the GPU machine's
    # `pip install --no-deps -e .` does not bring.
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-v", "-m", "cuda", "-p", "no:cacheprovider", "-rfE",
           "--continue-on-collection-errors", *paths]
    open(out_path, "w").close()
    code, timed_out = run_to_file(cmd, out_path, timeout, env)
    lines = [ln.strip() for ln in open(out_path, errors="replace").read().splitlines() if ln.strip()]
    failures = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    summaries = [ln for ln in lines if ln.startswith("=") and (" in " in ln or "passed" in ln or "skipped" in ln)]
    summary = summaries[-1].strip("= ") if summaries else (lines[-1][:300] if lines else "no output")
    name = os.path.basename(out_path)
    if timed_out:
        done = {k: sum(ln.endswith(k) or f" {k} " in ln for ln in lines) for k in ("PASSED", "FAILED", "SKIPPED")}
        statuses = (*done, "ERROR", "XFAIL", "XPASS")
        running = [ln.split()[0] for ln in lines if "::" in ln and not any(k in ln for k in statuses)]
        text = (f"CUDA tests (`pytest -m cuda {' '.join(paths)}`): timed out after {timeout:.0f} s, partial output in "
                f"{name} ({', '.join(f'{v} {k.lower()}' for k, v in done.items())} before it"
                f"{'; it was running ' + running[-1] if running else ''}; last: {summary})")
    else:
        text = f"CUDA tests (`pytest -m cuda {' '.join(paths)}`, exit {code}): {summary} (output in {name})"
    return "\n".join([text] + [f"  {ln}" for ln in failures[:20]])


class Log:
    """Timestamped events, appended and flushed (subprocess output shares the file), echoed to stdout."""

    def __init__(self, path: str, start: float):
        self.path, self.start = path, start
        open(path, "w").close()

    def __call__(self, message: str, echo: bool = True) -> None:
        with open(self.path, "a") as f:
            f.write(f"[{time.monotonic() - self.start:7.1f} s] {message}\n")
        if echo:
            print(message, flush=True)


class Tracebacks:
    """<out>.tracebacks.txt, created at the first failure; each entry numbered so a table cell can point to it."""

    def __init__(self, path: str):
        self.path, self.n = path, 0

    def add(self, title: str, text: str) -> str:
        self.n += 1
        with open(self.path, "a") as f:
            f.write(f"=== #{self.n} {title} ===\n{text.rstrip()}\n\n")
            f.flush()
            os.fsync(f.fileno())
        return f"traceback #{self.n} in {os.path.basename(self.path)}"


class Stopped(Exception):
    """SIGTERM arrived (a polite kill at a time limit): end like a finished run, with what is done."""


def supervised(name: str, out: str, report, say, body) -> int:
    """Run body(log, tracebacks, start, live) as a script's whole run: its event log <out>.log and tracebacks file
    <out>.tracebacks.txt; SIGTERM, or the script's own bug, ends it like a finished run (`say` records why in the
    report); every worker still in `live` is killed; the report ends with the total time and its path is printed
    last. Returns body's exit code (143 after SIGTERM, 1 after its own bug)."""
    start = time.monotonic()
    log, tracebacks, live = Log(out + ".log", start), Tracebacks(out + ".tracebacks.txt"), []
    report.write()

    def on_term(*_):
        raise Stopped("SIGTERM")

    signal.signal(signal.SIGTERM, on_term)
    code = 1
    try:
        code = body(log, tracebacks, start, live)
    except Stopped:
        say(f"stopped by SIGTERM; {report.status.strip('_') or 'before the first group'}")
        code = 143
    except BaseException as e:  # noqa: BLE001  (the script's own bug: still keep every row, say where it broke)
        ref = tracebacks.add(f"{name} itself", traceback.format_exc())
        say(f"{name} itself failed: {type(e).__name__}: {e} ({ref}); {report.status.strip('_')}")
    finally:
        for w in live:  # whatever still runs would outlive this report
            if w.proc.poll() is None:
                w.proc.kill()
        report.status = f"total {time.monotonic() - start:.0f} s"
        report.write()
        log(f"report: {out}")
    return code


# --- inputs and masks ---

def make_case(B, Hq, Hkv, T, D, mask, window, device, dtype, seed=0):
    """Inputs q: (B, Hq, T, D), k, v: (B, Hkv, T, D), sinks: (Hq,), alpha: (B, Hq, T), alpha_ma: (Hq,), and the
    op keyword arguments of `mask`."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    tensors = {"q": r(B, Hq, T, D), "k": r(B, Hkv, T, D), "v": r(B, Hkv, T, D),
               "sinks": torch.randn(Hq, generator=g).to(device) + 2.0,
               "alpha": torch.rand(B, Hq, T, generator=g).to(device), "alpha_ma": torch.full((Hq,), 0.5, device=device)}
    kw = {"is_causal": True}
    if mask == "padded":  # right padding: row b keeps its first T - (b % 4 + 1) * T / 8 keys
        valid = torch.arange(T)[None, :] < (T - (torch.arange(B)[:, None] % 4 + 1) * T // 8)
        kw["attn_mask"] = valid[:, None, None, :].to(device)
    elif mask == "documents":  # 8 documents per row, random lengths
        cuts = torch.stack([torch.randperm(T - 1, generator=g)[:7].sort().values + 1 for _ in range(B)])
        ids = torch.zeros(B, T, dtype=torch.long)
        for j in range(7):
            ids += (torch.arange(T)[None, :] >= cuts[:, j:j + 1]).long()
        kw["document_ids"] = ids.to(device)
    elif mask == "window":
        kw["window"] = window
    return tensors, kw


def variants():
    from affine_attention.ops import affine_scaled_attention, sink_attention, softmax_attention

    return {
        "softmax": (lambda t, kw, be: softmax_attention(t["q"], t["k"], t["v"], enable_gqa=True, backend=be, **kw),
                    ()),
        "sink": (lambda t, kw, be: sink_attention(t["q"], t["k"], t["v"], t["sinks"], enable_gqa=True, backend=be,
                                                  **kw), ("sinks",)),
        "affine": (lambda t, kw, be: affine_scaled_attention(t["q"], t["k"], t["v"], t["alpha"], t["alpha_ma"],
                                                             enable_gqa=True, backend=be, **kw), ("alpha",)),
    }


def references():
    from affine_attention.ops import (
        affine_scaled_attention_reference, sink_attention_reference, softmax_attention_reference,
    )

    return {
        "softmax": lambda t, kw: softmax_attention_reference(t["q"], t["k"], t["v"], enable_gqa=True, **kw)[0],
        "sink": lambda t, kw: sink_attention_reference(t["q"], t["k"], t["v"], t["sinks"], enable_gqa=True, **kw)[0],
        "affine": lambda t, kw: affine_scaled_attention_reference(t["q"], t["k"], t["v"], t["alpha"], t["alpha_ma"],
                                                                  enable_gqa=True, **kw)[0],
    }


def served_by(t, kw, needs_lse: bool, forced: str | None) -> str:
    """The backend the dispatcher picks for this call (the forced one, or the automatic choice); q: (B, Hq, T, D).

    The only use of the library's internals (mask parsing, the dispatcher): if they are refactored, this is the one
    place to follow them."""
    from affine_attention.ops.backends import Call, select
    from affine_attention.ops.masks import parse_mask

    q, k = t["q"], t["k"]
    B, Hq, T, _ = q.shape
    mask = parse_mask(kw.get("attn_mask"), kw.get("is_causal", False), B, Hq, T, k.shape[2], q.device,
                      window=kw.get("window"), document_ids=kw.get("document_ids"))
    return select(Call.of(q, k, mask, needs_lse), forced).name


# Profiler event names (aten ops, CUDA kernels) -> the SDPA implementation, most specific first.
SDPA_KINDS = [("cudnn", "cudnn"), ("efficient_attention", "efficient"), ("fmha_cutlass", "efficient"),
              ("flash_attention_for_cpu", "flash (cpu)"), ("fused_attention_overrideable", "overrideable"),
              ("scaled_dot_product_attention_math", "math"), ("flash", "flash")]


def sdpa_kernel(fn, device) -> tuple[str, list[str]]:
    """Which SDPA implementation one call of fn ran (flash / efficient / math / cudnn, and CPU flash), from the
    profiler's aten op and CUDA kernel names; and those names (for the log)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    kinds, names = set(), set()
    for e in prof.events():
        if not e.name.startswith("aten::") and e.device_type != DeviceType.CUDA:
            continue  # autograd nodes and record_function ranges name things, not what ran
        low = e.name.lower()
        for needle, kind in SDPA_KINDS:
            if needle in low:
                kinds.add(kind)
                names.add(e.name[:120])
                break
    return (" + ".join(sorted(kinds)) or "none seen"), sorted(names)


# --- timing and memory ---

def timer(device):
    """fn -> seconds of one call: CUDA events on a GPU, perf_counter around a synchronisation elsewhere."""
    import torch

    if device.type == "cuda":
        def measure(fn):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / 1e3
        return measure

    def measure(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return measure


def paired_times(methods: dict, baseline: str, device, repeats: int, warmup: int) -> dict[str, tuple[float, float]]:
    """Per method (median seconds, median ratio to the baseline timed in the same repeat, order shuffled)."""
    measure = timer(device)
    rng = random.Random(0)
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in methods}
    for _ in range(repeats):
        order = list(methods)
        rng.shuffle(order)
        for name in order:
            times[name].append(measure(methods[name]))
    base = times[baseline]
    return {n: (statistics.median(ts), statistics.median(a / b for a, b in zip(ts, base))) for n, ts in times.items()}


def peak_mib(fn, device) -> float:
    from common import peak_memory_bytes

    return peak_memory_bytes(fn, device) / 2**20


def leaves(t, extra_names):
    return [t["q"], t["k"], t["v"]] + [t[n] for n in extra_names]


def step(fn, t, kw, backend, extra_names, backward: bool):
    """One forward (no_grad) or forward+backward call of a variant."""
    import torch

    if not backward:
        def fwd():
            with torch.no_grad():
                return fn(t, kw, backend)
        return fwd
    inputs = leaves(t, extra_names)

    def fwd_bwd():
        out = fn(t, kw, backend)
        return torch.autograd.grad(out, inputs, torch.ones_like(out))
    return fwd_bwd


def errors(fn, ref_fn, t, kw, backend, extra_names, rows=2) -> list[float]:
    """max |low - float64| / max |float64| of out and every gradient, on the first `rows` batch rows."""
    import torch

    def sl(x):
        return x[:rows] if x.dim() >= 2 and x.shape[0] == t["q"].shape[0] else x

    small = {n: sl(x).detach() for n, x in t.items()}
    kw_small = {n: (sl(x) if torch.is_tensor(x) else x) for n, x in kw.items()}
    low = {n: (x.clone().requires_grad_(n in ("q", "k", "v") + extra_names)) for n, x in small.items()}
    high = {n: (x.double().requires_grad_(n in ("q", "k", "v") + extra_names)) for n, x in small.items()}
    out = fn(low, kw_small, backend)
    ref = ref_fn(high, kw_small)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(ref.device)
    got = torch.autograd.grad(out, leaves(low, extra_names), g.to(out.dtype))
    want = torch.autograd.grad(ref, leaves(high, extra_names), g)
    return [rel(a, b) for a, b in zip((out,) + got, (ref,) + want)]


def rel(a, b) -> float:
    """max |a - b| / max |b|, in float64 (b the reference)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def with_kernel(row: dict, fn, device, rec: Records) -> dict:
    """row plus its "sdpa kernel" cell when the sdpa backend serves it (what SDPA itself picked, profiled)."""
    if row.get("backend") != "sdpa":
        return dict(row, **{"sdpa kernel": "—"})
    try:
        kind, names = sdpa_kernel(fn, device)
    except Exception as e:  # noqa: BLE001  (the profiler must not cost the row; the log keeps why)
        rec.put(note=f"{row.get('mask')} {row.get('variant')}: profiling SDPA failed: {traceback.format_exc()}")
        return dict(row, **{"sdpa kernel": f"unknown ({type(e).__name__})"})
    rec.put(note=f"{row.get('mask')} {row.get('variant')}: sdpa ran {kind}: {', '.join(names)}")
    return dict(row, **{"sdpa kernel": kind})


# --- the jobs ---

def bench_config(args, rec: Records, device, job: dict) -> None:
    """One (T, heads, mask) group: every variant timed against the same kernel's softmax, then one row per variant
    (backend, SDPA kernel, peak memory, bf16-vs-float64 errors), each recorded as soon as it is known."""
    import torch

    T, Hq, Hkv, mask, gid = job["T"], job["Hq"], job["Hkv"], job["mask"], job["id"]
    inject(args, gid, None, device)
    forced = "cuda_flash" if device.type == "cuda" else None  # the CPU dry run: the automatic choice
    B = max(1, args.tokens // T)
    t, kw = make_case(B, Hq, Hkv, T, args.head_dim, mask, args.window, device, torch.bfloat16)
    for n in ("q", "k", "v", "sinks", "alpha"):
        t[n].requires_grad_()
    vs, refs = variants(), references()
    kernel = {}  # variant -> the backend that serves it (forced when it can, else the automatic choice)
    for name in vs:
        try:
            served_by(t, kw, name == "sink", forced)
            kernel[name] = forced
        except ValueError:
            kernel[name] = None
    methods = {(name, bwd): step(fn, t, kw, kernel[name], extras, bwd) for name, (fn, extras) in vs.items()
               for bwd in (False, True)}
    auto = mask == "causal"  # the automatic choice for plain softmax (SDPA), against the same kernel's softmax
    if auto:
        methods.update({("softmax (auto)", bwd): step(vs["softmax"][0], t, kw, None, (), bwd) for bwd in (False, True)})
    timed = {}
    for bwd in (False, True):
        group = {name: fn for (name, b), fn in methods.items() if b == bwd}
        timed[bwd] = paired_times(group, "softmax", device, args.repeats, args.warmup)
    for name in [*vs, *(["softmax (auto)"] if auto else [])]:
        def row(name=name):
            inject(args, gid, name, device)
            base = name if name in vs else "softmax"
            extras = vs[base][1]
            cells = dict(job["key"], variant=name, backend=served_by(t, kw, base == "sink", kernel.get(name)))
            cells = with_kernel(cells, methods[(name, True)], device, rec)
            errs = [None] * 5
            if T <= args.error_max_t and name in vs:
                e = errors(vs[name][0], refs[name], t, kw, kernel[name], extras)
                errs = e + [None] * (5 - len(e))
            fwd, fb = timed[False][name], timed[True][name]
            cells.update({"fwd ms": fmt(fwd[0] * 1e3, ".3f"), "fwd / softmax": fmt(fwd[1], ".3f"),
                          "fwd+bwd ms": fmt(fb[0] * 1e3, ".3f"), "fwd+bwd / softmax": fmt(fb[1], ".3f"),
                          "peak MiB fwd+bwd": fmt(peak_mib(methods[(name, True)], device), ".0f")})
            cells.update(zip(("err out", "err dq", "err dk", "err dv", "err dsinks/dalpha"),
                             (fmt(x, ".1e") for x in errs)))
            yield cells
        guarded(rec, device, "main", dict(job["key"], variant=name), row)


def epilogue_rows(args, rec: Records, device, job: dict) -> None:
    """affine with each fused-epilogue implementation, timed against the kernel alone (softmax)."""
    import torch
    from affine_attention.ops.epilogue import IMPLS, use_epilogue

    inject(args, job["id"], None, device)
    forced = "cuda_flash" if device.type == "cuda" else None
    T, Hq, Hkv = job["T"], job["Hq"], job["Hkv"]
    B = max(1, args.tokens // T)
    t, kw = make_case(B, Hq, Hkv, T, args.head_dim, "causal", args.window, device, torch.bfloat16)
    for n in ("q", "k", "v", "alpha"):
        t[n].requires_grad_()
    vs = variants()
    for impl in IMPLS:
        key = dict(job["key"], variant=f"affine (epilogue {impl})")
        if impl == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            rec.put(table="main", row=dict(key, backend="not run (no CUDA)"))
            continue

        def row(impl=impl):
            def under(fn):
                def go():
                    with use_epilogue(impl):
                        return fn()
                return go
            res = {}
            for bwd in (False, True):
                group = {"softmax": step(vs["softmax"][0], t, kw, forced, (), bwd),
                         "affine": under(step(vs["affine"][0], t, kw, forced, ("alpha",), bwd))}
                res[bwd] = paired_times(group, "softmax", device, args.repeats, args.warmup)["affine"]
            cells = with_kernel(dict(key, backend=served_by(t, kw, False, forced)),
                                under(step(vs["affine"][0], t, kw, forced, ("alpha",), True)), device, rec)
            cells.update({"fwd ms": fmt(res[False][0] * 1e3, ".3f"), "fwd / softmax": fmt(res[False][1], ".3f"),
                          "fwd+bwd ms": fmt(res[True][0] * 1e3, ".3f"), "fwd+bwd / softmax": fmt(res[True][1], ".3f")})
            yield cells
        guarded(rec, device, "main", key, row)


def epilogue_numerics(args, rec: Records, device, job: dict) -> None:
    """The Triton epilogue against the eager one, forward and backward, per dtype and gate shape: for each tensor
    "max abs / max rel" of triton - eager, and both against the eager epilogue in float64. Off CUDA the Triton
    side runs only under TRITON_INTERPRET=1; otherwise its cells say so."""
    import torch
    from affine_attention.ops.epilogue import epilogue

    inject(args, job["id"], None, device)
    T, (Hq, Hkv), D = args.numerics_t, args.heads[0], args.head_dim
    B = max(1, args.tokens // T)
    run_triton = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    gates = {"elementwise (B, Hq, T, D)": (B, Hq, T, D), "headwise (B, Hq, T, 1)": (B, Hq, T, 1), "none": None}
    for dtype in (torch.bfloat16, torch.float32):
        for gate_name, gate_shape in gates.items():
            key = {"dtype": str(dtype).replace("torch.", ""), "gate": gate_name, "B, Hq/Hkv, T, D": f"{B}, {Hq}/{Hkv}, "
                   f"{T}, {D}"}

            def rows(dtype=dtype, gate_shape=gate_shape, key=key):
                g = torch.Generator().manual_seed(2)

                def r(*shape, dt=dtype, fn=torch.randn):
                    return fn(*shape, generator=g).to(device=device, dtype=dt)

                # out: (B, Hq, T, D) kernel output; alpha: (B, Hq, T); alpha_ma: (Hq,); v_mean: (B, Hkv, T, D) in
                # float32 (the mean of V is accumulated in float32); gate: gate_shape.
                x = {"out": r(B, Hq, T, D), "alpha": r(B, Hq, T, dt=torch.float32, fn=torch.rand),
                     "alpha_ma": r(Hq, dt=torch.float32, fn=torch.rand),
                     "v_mean": r(B, Hkv, T, D, dt=torch.float32)}
                if gate_shape:
                    x["gate"] = r(*gate_shape, fn=torch.rand)
                w = r(B, Hq, T, D)

                def run(impl, cast):
                    ins = {n: cast(v).detach().requires_grad_() for n, v in x.items()}
                    y = epilogue(ins["out"], alpha=ins["alpha"], alpha_ma=ins["alpha_ma"], v_mean=ins["v_mean"],
                                 gate=ins.get("gate"), impl=impl)
                    return dict(zip(["out"] + [f"d {n}" for n in ins],
                                    (y,) + torch.autograd.grad(y, list(ins.values()), cast(w))))

                eager, exact = run("eager", lambda v: v), run("eager", lambda v: v.double())
                tri = run("triton", lambda v: v) if run_triton else None
                cells = dict(key, **{"rel eager vs float64": fmt(max(rel(eager[n], exact[n]) for n in eager), ".1e")})
                for n in ("out", "d out", "d alpha", "d alpha_ma", "d gate", "d v_mean"):
                    if n not in eager:
                        cells[n] = "—"
                    elif tri is None:
                        cells[n] = "not run (no CUDA)"
                    else:
                        abs_err = (tri[n].double() - eager[n].double()).abs().max().item()
                        cells[n] = f"{abs_err:.1e} / {rel(tri[n], eager[n]):.1e}"
                cells["rel triton vs float64"] = ("not run (no CUDA)" if tri is None else
                                                  fmt(max(rel(tri[n], exact[n]) for n in tri), ".1e"))
                yield cells
            guarded(rec, device, "numerics", key, rows)


def versions(device) -> str:
    import torch

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    for mod in ("transformers", "triton", "flash_attn"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001  (absent or broken: say so, never fail the check)
            parts.append(f"{mod} not available")
    if device.type == "cuda" and torch.cuda.is_available():
        parts.insert(0, f"{torch.cuda.get_device_name()} (sm {'.'.join(map(str, torch.cuda.get_device_capability()))},"
                        f" CUDA {torch.version.cuda})")
    else:
        parts.insert(0, f"CPU dry run ({platform.machine()}, {torch.get_num_threads()} threads)")
    return ", ".join(parts)


def warm_up() -> None:
    """The imports and the profiler's first start (seconds each) now, while the previous group still runs, not in
    the timed job. A failure here shows again inside the job, recorded there."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        import affine_attention.ops  # noqa: F401
        import affine_attention.ops.epilogue  # noqa: F401
        import common  # noqa: F401

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
            torch.zeros(1) + 1
    except Exception:  # noqa: BLE001
        pass


JOBS = {"config": bench_config, "epilogue": epilogue_rows, "numerics": epilogue_numerics}


def worker_main(args, jobs: dict) -> int:
    """Get ready (imports, CUDA context), run the one job read from stdin with jobs[job["kind"]], record it; see the
    module docstring. The calling script hands over its job table (this module imports none of its callers)."""
    base = args.worker
    stack = open(base + ".stack.txt", "w")
    faulthandler.enable(file=stack, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    rec = Records(base + ".jsonl")
    for path in (HERE, ROOT):
        if path not in sys.path:
            sys.path.insert(0, path)
    import torch

    device = torch.device(args.device)
    ready = {"pid": os.getpid(), "cuda": torch.cuda.is_available()}
    if args.worker_versions:
        ready["versions"] = versions(device)
    if device.type == "cuda" and ready["cuda"]:
        try:
            torch.zeros(1, device=device)  # the context now, while the previous group still runs
        except Exception as e:  # noqa: BLE001  (the job then fails with it, recorded)
            ready["cuda_error"] = f"{type(e).__name__}: {e}"
    warm_up()
    rec.put(ready=ready)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    job = json.loads(line)
    rec.put(start=job["id"])
    try:
        jobs[job["kind"]](args, rec, device, job)
    except Exception as e:  # noqa: BLE001  (the group's setup or timing failed: one row says so)
        rec.failure(job["table"], job["key"], e)
    finish(rec, 0)
    return 0
