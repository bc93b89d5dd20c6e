"""The variant epilogue on CPU: affine (and affine + gate) forward+backward time as paired ratios to plain SDPA, and
peak memory, for the one-pass epilogue (ops/epilogue.py) against the former eager combine, rebuilt here as it was.

    python benchmarks/bench_epilogue.py                    # T = 2048, 4096; float32, bfloat16; Hq/Hkv 8/8, 8/2
    python benchmarks/bench_epilogue.py --quick            # a short smoke run

Memory is reported three ways, as ratios to SDPA: `common.peak_memory_bytes` over forward+backward (the project's
method: profiler memory per event, which counts an allocation once for every op that encloses it, so nested
allocations count several times); `common.allocator_peak_bytes` over forward+backward (the raw allocation records in time
order: the bytes actually live at the peak); and the bytes a forward leaves allocated (its output and what autograd
saved for backward: what every layer of a model holds until its backward runs).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import allocations, allocator_peak_bytes, emit, paired_ratios, peak_memory_bytes  # noqa: E402

from affine_attention._compat import float_acc  # noqa: E402
from affine_attention.ops import affine_scaled_attention  # noqa: E402
from affine_attention.ops.attention import attention_with_epilogue  # noqa: E402
from affine_attention.ops.backends import attention as kernel_attention  # noqa: E402
from affine_attention.ops.masks import parse_mask
from affine_attention.ops.visible_sums import visible_sum_and_count  # noqa: E402


def former_affine(q, k, v, alpha, alpha_ma, gate=None):
    """The combine as the op computed it before the epilogue (causal, bias_norm="visible"), gate as a second pass.

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D); alpha: (B, Hq, T); alpha_ma: (Hq,); gate: (B, Hq, T, D) or None.
    """
    B, Hq, T, D = q.shape
    mask = parse_mask(None, True, B, Hq, T, k.shape[2], q.device)
    attn, _ = kernel_attention(q, k, v, mask, D ** -0.5)
    acc = float_acc(q.dtype)
    total, count = visible_sum_and_count(v, mask, Hq)
    v_mean = total / count.clamp(min=1)
    a = alpha.to(acc)[..., None]
    b = alpha_ma.to(acc)[None, :, None, None] - a
    G = Hq // v_mean.shape[1]
    bias_term = (b.view(B, Hq // G, G, T, 1) * v_mean.to(acc)[:, :, None]).view(B, Hq, T, D)
    out = torch.addcmul(bias_term, a, attn.to(acc)).to(q.dtype)
    return out if gate is None else out * gate


def held_after_forward_bytes(forward) -> int:
    """Bytes a forward leaves allocated while its output is alive: the output plus the tensors saved for backward."""
    keep = []
    held = sum(allocations(lambda: keep.append(forward())))
    keep.clear()
    return held


def make_methods(B, Hq, Hkv, T, D, dtype):
    """Forward+backward closures over shared inputs: q (B, Hq, T, D), k, v (B, Hkv, T, D), alpha (B, Hq, T)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    q, k, v = r(B, Hq, T, D), r(B, Hkv, T, D), r(B, Hkv, T, D)
    alpha = torch.rand(B, Hq, T, generator=g).requires_grad_()
    alpha_ma = torch.full((Hq,), 0.5)
    gate = torch.rand(B, Hq, T, D, generator=g).to(dtype).requires_grad_()
    gqa = Hq != Hkv
    leaves = (q, k, v, alpha, gate)

    def run(f):
        def go():
            out = f()
            for t in leaves:
                t.grad = None
            out.backward(torch.ones_like(out))
        return go

    forwards = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa),
        "affine_former": lambda: former_affine(q, k, v, alpha, alpha_ma),
        "affine": lambda: affine_scaled_attention(q, k, v, alpha, alpha_ma, is_causal=True, enable_gqa=gqa),
        "affine_gated_former": lambda: former_affine(q, k, v, alpha, alpha_ma, gate),
        "affine_gated": lambda: attention_with_epilogue(q, k, v, alpha=alpha, alpha_ma=alpha_ma, gate=gate,
                                                        is_causal=True, enable_gqa=gqa),
    }
    return forwards, {name: run(f) for name, f in forwards.items()}


NAMES = ["affine_former", "affine", "affine_gated_former", "affine_gated"]
MEMORY_NAMES = ["sdpa", "affine_former", "affine", "affine_gated_former", "affine_gated"]
MEMORY_KINDS = {"mem": "peak (common.py)", "live": "live peak", "held": "held after fwd"}


def bench(args):
    rows = []
    for dtype in args.dtypes:
        for hkv in args.kv_heads:
            for T in args.lengths:
                forwards, methods = make_methods(1, args.heads, hkv, T, args.head_dim, getattr(torch, dtype))
                res = paired_ratios(methods, "sdpa", torch.device("cpu"), repeats=args.repeats)
                row = {"dtype": dtype, "heads": f"{args.heads}/{hkv}", "T": T, "sdpa_ms": res["sdpa"]["median_s"] * 1e3}
                row.update({n: res[n]["ratio"] for n in NAMES})
                if args.memory:
                    for n in MEMORY_NAMES:
                        row[f"mem_{n}"] = peak_memory_bytes(methods[n], torch.device("cpu"))
                        row[f"live_{n}"] = allocator_peak_bytes(methods[n])
                        row[f"held_{n}"] = held_after_forward_bytes(forwards[n])
                rows.append(row)
                print(" | ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
    return rows


def markdown(rows, memory: bool) -> str:
    head = "| dtype | Hq/Hkv | T | SDPA ms | " + " | ".join(f"{n} / SDPA" for n in NAMES)
    sep = "|---|---|---|---|" + "---|" * len(NAMES)
    lines = [f"threads: {torch.get_num_threads()}, torch {torch.__version__}, B = 1, causal, fwd+bwd", "",
             head + " |", sep]
    for r in rows:
        cells = [r["dtype"], r["heads"], str(r["T"]), f"{r['sdpa_ms']:.1f}"] + [f"{r[n]:.3f}x" for n in NAMES]
        lines.append("| " + " | ".join(cells) + " |")
    if memory:
        lines += ["", "| dtype | Hq/Hkv | T | memory | SDPA MiB | " + " | ".join(f"{n} / SDPA" for n in MEMORY_NAMES[1:])
                  + " |", "|---|---|---|---|---|" + "---|" * (len(MEMORY_NAMES) - 1)]
        for r in rows:
            for kind, label in MEMORY_KINDS.items():
                base = r[f"{kind}_sdpa"]
                cells = [r["dtype"], r["heads"], str(r["T"]), label, f"{base / 2**20:.1f}"]
                cells += [f"{r[f'{kind}_{n}'] / base:.2f}x" for n in MEMORY_NAMES[1:]]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short smoke run")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--no-memory", dest="memory", action="store_false")
    p.add_argument("--out", help="also write the markdown table here")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.dtypes, args.kv_heads, args.repeats = [512], ["float32"], [2], 3
    emit(markdown(bench(args), args.memory), args.out)


if __name__ == "__main__":
    main()
