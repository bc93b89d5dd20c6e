"""What the non-finite guarantee costs on the fast path (ops/nonfinite.py): the library's softmax and affine against
raw `scaled_dot_product_attention` on the same inputs, with the rule on its eager-CPU path (ask first), on its
accelerator path (every row tested, as on CUDA or under torch.compile), and switched off (the same call without it).
Ratios are medians over paired repeats in this process.

    python benchmarks/bench_isolation.py                      # T = 2048 and 4096, median of 7
    python benchmarks/bench_isolation.py --compiled           # the same calls under torch.compile (inductor)
    python benchmarks/bench_isolation.py --lengths 256 --repeats 3 --quick

Under torch.compile the rule always takes its accelerator path (nothing may be read on the host), and inductor fuses
its row tests and masked copies with the neighbouring ops; the eager_cpu column is then "—".

Run at an older commit (before ops/nonfinite.py), the same command measures the rule as it was then.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import types

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import paired_times  # noqa: E402

from affine_attention.ops import affine_scaled_attention, softmax_attention  # noqa: E402
from affine_attention.ops import attention as ops_attention  # noqa: E402


class _Compiling:
    """torch, but for torch.compiler.is_compiling(), which answers True."""
    compiler = types.SimpleNamespace(is_compiling=lambda: True)

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def rule(path: str):
    """path: "eager_cpu" (as shipped on CPU), "accelerator" (never ask the data first), "off" (no rule). On CUDA
    "accelerator" is what ships (the fused Triton passes, ops/nonfinite_triton.py); benchmarks/gpu_session.py's S1
    uses "off" for its isolation-off row."""
    try:
        from affine_attention.ops import nonfinite
    except ImportError:  # an older commit: the rule lived in ops/attention.py
        nonfinite = None
    saved = {}

    def patch(mod, name, fn):
        saved[(mod, name)] = getattr(mod, name)
        setattr(mod, name, fn)
    if path == "off" and nonfinite is not None:
        patch(nonfinite, "isolate", lambda q, k, v, mask, scale, known=None, impl=None: (k, v, None))
        patch(nonfinite, "poison", lambda out, seen, q, alpha, impl=None: out)
    elif path == "off":
        patch(ops_attention, "_isolate_nonfinite", lambda k, v, mask, Hq, known=None: (k, v, None))
        patch(ops_attention, "_poison_seen", lambda out, seen: out)
        patch(ops_attention, "_poison_queries", lambda out, q, alpha: out)
    elif path == "accelerator" and nonfinite is not None:
        patch(nonfinite, "_asks", lambda t: False)
    elif path == "accelerator":  # the old rule asked torch.compiler.is_compiling(): answer yes to that module alone
        patch(ops_attention, "torch", _Compiling())
    try:
        yield
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)


def _timed(f, backward: bool, compiled: bool):
    """f() -> (B, H, T, D): one timed call, with its backward (of the sum) when asked, compiled when asked."""
    if compiled:
        f = torch.compile(f, dynamic=False)

    def go():
        out = f()
        if backward:
            out.sum().backward()
    return go


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--heads", type=int, nargs=2, default=[8, 2], metavar=("HQ", "HKV"))
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="one warm-up call")
    p.add_argument("--compiled", action="store_true", help="every call under torch.compile (inductor, forward only)")
    a = p.parse_args(argv)
    dev = torch.device("cpu")
    Hq, Hkv, D = a.heads[0], a.heads[1], a.head_dim
    print("| T | pass | op | raw SDPA ms | eager_cpu / raw | accelerator / raw | off / raw |")
    print("|---|---|---|---|---|---|---|")
    for T in a.lengths:
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(1, h, T, D, generator=g).requires_grad_(not a.compiled) for h in (Hq, Hkv, Hkv))
        alpha, alpha_ma = torch.rand(1, Hq, T, generator=g).requires_grad_(not a.compiled), torch.rand(Hq, generator=g)
        for backward in (False,) if a.compiled else (False, True):
            ops = {"softmax": lambda: softmax_attention(q, k, v, is_causal=True, enable_gqa=True),
                   "affine": lambda: affine_scaled_attention(q, k, v, alpha, alpha_ma, is_causal=True,
                                                             enable_gqa=True)}
            for name, op in ops.items():
                paths = ("accelerator", "off") if a.compiled else ("eager_cpu", "accelerator", "off")
                methods = {"raw": _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                               enable_gqa=True), backward, a.compiled)}
                for path in paths:
                    # One compiled function per path, always called under its rule: dynamo guards on the patched
                    # functions, so a call outside it would recompile the other path.
                    go = _timed(op, backward, a.compiled)

                    def under(path=path, go=go):
                        with rule(path):
                            go()
                    methods[path] = under
                times = paired_times(methods, dev, a.repeats, warmup=1 if a.quick else 2)
                r = {m: statistics.median(t / b for t, b in zip(times[m], times["raw"])) for m in methods}
                print(f"| {T} | {'fwd+bwd' if backward else 'fwd'} | {name} | "
                      f"{statistics.median(times['raw']) * 1e3:.1f} | "
                      f"{'—' if a.compiled else format(r['eager_cpu'], '.3f')} | "
                      f"{r['accelerator']:.3f} | {r['off']:.3f} |", flush=True)
    print(f"\nB = 1, Hq/Hkv = {Hq}/{Hkv}, D = {D}, float32, causal, CPU ({torch.get_num_threads()} threads), "
          f"median of {a.repeats} paired repeats; {'torch.compile (inductor)' if a.compiled else 'eager'}; "
          f"torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
