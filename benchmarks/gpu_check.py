"""The one prepared check for a lent GPU machine: install, the CUDA tests, then one markdown table of the attention
kernels (time ratios to the same kernel's plain softmax, peak memory, bf16-vs-float64 errors). Under 8 minutes.

On the lent machine (one H200, Python 3.12, torch 2.11, no network), from the repository root:

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --install --out $OUT/gpu_check.md    # about 3-5 minutes

(with the device tool: that command, timeout_s 540; $OUT is the folder whose files come back).

CPU dry run (CI; the same code paths on tiny sizes, well under a minute):

    python3 benchmarks/gpu_check.py --device cpu --quick

Rows: bf16, D = 128, T in {1024, 1088, 4096, 16384} (1088 = 8.5 x 128: a partial last kernel block), B = 16384 // T,
Hq/Hkv in {32/8, 16/16}, masks causal / padded (right padding of 1/8..4/8 of each row) / 8 documents per row /
window 4096 (equal to causal while T <= 4096). Every variant is forced onto one kernel backend (cuda_flash on a GPU)
and timed against that backend's plain softmax on the same inputs; "softmax (auto)" is the automatic choice (SDPA)
on the same call. Errors: max |bf16 - float64| / max |float64| over the first two batch rows, at T <= 1088 only
(the float64 reference materialises T x T weights).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def install() -> str:
    """pip install --no-deps -e . (torch, transformers and triton are already on the lent machine). Offline, build
    isolation cannot fetch setuptools, so the installed one is tried first. Returns one line for the report."""
    base = [sys.executable, "-m", "pip", "install", "--no-deps", "-e", ROOT]
    for cmd in (base[:5] + ["--no-build-isolation"] + base[5:], base):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode == 0:
            return f"installed: `{' '.join(cmd[2:])}`"
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
    return f"install failed (exit {done.returncode}: {tail[0][:200]}); running from the source tree instead"


def run_cuda_tests(paths: list[str], timeout: float) -> str:
    """The tests marked `cuda` (they skip without a GPU); returns pytest's summary line."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-rfE",
           "--continue-on-collection-errors", *paths]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"CUDA tests: timed out after {timeout:.0f} s"
    lines = [ln for ln in done.stdout.strip().splitlines() if ln.strip()]
    failures = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    summary = lines[-1] if lines else done.stderr.strip()[-300:]
    text = f"CUDA tests (`pytest -m cuda {' '.join(paths)}`, exit {done.returncode}): {summary}"
    return "\n".join([text] + [f"  {ln}" for ln in failures[:20]])


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
    """The backend the dispatcher picks for this call (the forced one, or the automatic choice)."""
    from affine_attention.ops.backends import Call, select
    from affine_attention.ops.masks import parse_mask

    q, k = t["q"], t["k"]
    B, Hq, T, _ = q.shape
    mask = parse_mask(kw.get("attn_mask"), kw.get("is_causal", False), B, Hq, T, k.shape[2], q.device,
                      window=kw.get("window"), document_ids=kw.get("document_ids"))
    return select(Call.of(q, k, mask, needs_lse), forced).name


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
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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


def errors(name, fn, ref_fn, t, kw, backend, extra_names, rows=2) -> list[float]:
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
    return [((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()
            for a, b in zip((out,) + got, (ref,) + want)]


# --- the table ---

COLUMNS = ["T", "B", "Hq/Hkv", "mask", "variant", "backend", "fwd ms", "fwd / softmax", "fwd+bwd ms",
           "fwd+bwd / softmax", "peak MiB fwd+bwd", "err out", "err dq", "err dk", "err dv", "err dsinks/dalpha"]


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def bench_config(args, device, dtype, T, Hq, Hkv, mask, forced):
    import torch

    B = max(1, args.tokens // T)
    t, kw = make_case(B, Hq, Hkv, T, args.head_dim, mask, args.window, device, dtype)
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
    rows = []
    for name in [*vs, *(["softmax (auto)"] if auto else [])]:
        base = name if name in vs else "softmax"
        extras = vs[base][1]
        backend = served_by(t, kw, base == "sink", kernel.get(name))
        mem = peak_mib(methods[(name, True)], device)
        errs = [None] * 5
        if T <= args.error_max_t and name in vs:
            e = errors(name, vs[name][0], refs[name], t, kw, kernel[name], extras)
            errs = e + [None] * (5 - len(e))
        fwd, fb = timed[False][name], timed[True][name]
        rows.append([str(T), str(B), f"{Hq}/{Hkv}", mask, name, backend, fmt(fwd[0] * 1e3, ".3f"),
                     fmt(fwd[1], ".3f"), fmt(fb[0] * 1e3, ".3f"), fmt(fb[1], ".3f"), fmt(mem, ".0f"),
                     *[fmt(x, ".1e") for x in errs]])
    del t, kw, methods
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def epilogue_rows(args, device, dtype, forced) -> list[list[str]]:
    """affine with each fused-epilogue implementation vs the kernel alone (softmax), if the module exists."""
    if importlib.util.find_spec("affine_attention.ops.epilogue") is None:
        return []
    epi = importlib.import_module("affine_attention.ops.epilogue")
    use, impls = getattr(epi, "use_epilogue", None), getattr(epi, "IMPLS", ())
    if use is None:
        return []
    T, Hq, Hkv = args.lengths[0], args.heads[0][0], args.heads[0][1]
    B = max(1, args.tokens // T)
    t, kw = make_case(B, Hq, Hkv, T, args.head_dim, "causal", args.window, device, dtype)
    for n in ("q", "k", "v", "alpha"):
        t[n].requires_grad_()
    vs = variants()
    rows = []
    for impl in impls:
        if impl == "triton" and device.type != "cuda":
            continue

        def under(fn, impl=impl):
            def go():
                with use(impl):
                    return fn()
            return go
        res = {}
        for bwd in (False, True):
            group = {"softmax": step(vs["softmax"][0], t, kw, forced, (), bwd),
                     "affine": under(step(vs["affine"][0], t, kw, forced, ("alpha",), bwd))}
            res[bwd] = paired_times(group, "softmax", device, args.repeats, args.warmup)["affine"]
        rows.append([str(T), str(B), f"{Hq}/{Hkv}", "causal", f"affine (epilogue {impl})", forced or "auto",
                     fmt(res[False][0] * 1e3, ".3f"), fmt(res[False][1], ".3f"), fmt(res[True][0] * 1e3, ".3f"),
                     fmt(res[True][1], ".3f"), "—", "—", "—", "—", "—", "—"])
    return rows


def guarded(fn, fn_args, key: list[str]) -> list[list[str]]:
    """fn's rows, or one row saying how it failed: one broken configuration must not cost the whole table."""
    try:
        return fn(*fn_args)
    except Exception as e:  # noqa: BLE001  (reported in the table, never hidden)
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        message = f"{type(e).__name__}: {e}".replace("|", "/").replace("\n", " ")[:160]
        return [key + ["FAILED", message] + ["—"] * (len(COLUMNS) - len(key) - 2)]


def versions(device) -> str:
    import torch

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    for mod in ("transformers", "triton", "flash_attn"):
        try:
            parts.append(f"{mod} {importlib.import_module(mod).__version__}")
        except Exception:  # noqa: BLE001  (absent or broken: say so, never fail the check)
            parts.append(f"{mod} not available")
    if device.type == "cuda":
        parts.insert(0, f"{torch.cuda.get_device_name()} (sm {'.'.join(map(str, torch.cuda.get_device_capability()))},"
                        f" CUDA {torch.version.cuda})")
    else:
        parts.insert(0, f"CPU dry run ({platform.machine()}, {torch.get_num_threads()} threads)")
    return ", ".join(parts)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="tiny sizes (the CPU dry run)")
    p.add_argument("--install", action="store_true", help="pip install --no-deps -e . first")
    p.add_argument("--tests", nargs="*", default=None,
                   help="paths for `pytest -m cuda` (default: the test files that use the marker; an empty list "
                        "skips them)")
    p.add_argument("--out", default=None, help="also write the report (markdown) to this file")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop adding rows after this many seconds")
    a = p.parse_args(argv)
    if a.tests is None:  # the test files that mark tests `cuda` (importing the others needs packages not there)
        a.tests = sorted(os.path.join("tests", f) for f in os.listdir(os.path.join(ROOT, "tests"))
                         if f.startswith("test_") and f.endswith(".py")
                         and "mark.cuda" in open(os.path.join(ROOT, "tests", f)).read())
    if a.quick:
        a.lengths, a.heads, a.head_dim, a.tokens, a.window = [96], [(4, 2)], 128, 192, 32
        a.repeats, a.warmup, a.error_max_t = 1, 1, 96
    else:
        a.lengths, a.heads, a.head_dim, a.tokens, a.window = [1024, 1088, 4096, 16384], [(32, 8), (16, 16)], 128, \
            16384, 4096
        a.repeats, a.warmup, a.error_max_t = 5, 2, 1088
    return a


class Report:
    """Prints each line as soon as it is known (and appends it to --out), so a run cut short keeps its rows."""

    def __init__(self, path: str | None):
        self.path = path
        if path:
            open(path, "w").close()

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    installed = install() if args.install else None
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for the dry run", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    say = Report(args.out)
    say(f"# gpu_check\n\n{versions(device)}\n")
    if installed:
        say(installed + "\n")
    if args.tests:
        say(run_cuda_tests(args.tests, timeout=min(240.0, args.budget_s / 2)) + "\n")
    if importlib.util.find_spec("affine_attention.ops.epilogue") is None:
        say("affine epilogue: not available (no affine_attention.ops.epilogue)\n")
    # On a GPU every variant runs on cuda_flash; on the CPU dry run the automatic choice (cpu_flash / exact).
    forced = "cuda_flash" if device.type == "cuda" else None
    dtype = torch.bfloat16
    say("| " + " | ".join(COLUMNS) + " |")
    say("|" + "---|" * len(COLUMNS))
    skipped = []
    for T in args.lengths:
        for Hq, Hkv in args.heads:
            for mask in ("causal", "padded", "documents", "window"):
                if time.monotonic() - start > args.budget_s:
                    skipped.append(f"T={T} {Hq}/{Hkv} {mask}")
                    continue
                for row in guarded(bench_config, (args, device, dtype, T, Hq, Hkv, mask, forced),
                                   [str(T), "—", f"{Hq}/{Hkv}", mask]):
                    say("| " + " | ".join(row) + " |")
    if time.monotonic() - start < args.budget_s:
        for row in guarded(epilogue_rows, (args, device, dtype, forced), ["—", "—", "—", "causal"]):
            say("| " + " | ".join(row) + " |")
    if skipped:
        say(f"\nskipped (time budget {args.budget_s:.0f} s): " + "; ".join(skipped))
    say(f"\ntotal {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
