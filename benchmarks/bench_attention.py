"""Attention benchmark: each variant's fast path and the reference path, as time ratios to plain SDPA measured in
the same run (forward and forward+backward), peak memory, and the cost of one cached decoding step.

    python benchmarks/bench_attention.py            # full table (tens of minutes on 2 CPU cores)
    python benchmarks/bench_attention.py --quick    # a short smoke run
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import paired_ratios, peak_memory_bytes, time_once  # noqa: E402

from affine_attention.ops import (  # noqa: E402
    affine_scaled_attention, affine_scaled_attention_reference, sink_attention, sink_attention_reference,
)

REFERENCE_MAX_T = 2048  # the reference materialises (B, H, T, T) weights: beyond this it only measures swap


def make_inputs(B, Hq, Hkv, T, D, dtype, device, grad):
    """q: (B, Hq, T, D), k, v: (B, Hkv, T, D), alpha: (B, Hq, T), alpha_ma, sinks: (Hq,)."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_(grad)

    q, k, v = r(B, Hq, T, D), r(B, Hkv, T, D), r(B, Hkv, T, D)
    alpha = torch.rand(B, Hq, T, generator=g).to(device, torch.float32).requires_grad_(grad)
    sinks = torch.zeros(Hq, device=device).requires_grad_(grad)
    alpha_ma = torch.full((Hq,), 0.5, device=device)
    return q, k, v, alpha, alpha_ma, sinks


def methods_for(inputs, gqa: bool, T: int, backward: bool):
    q, k, v, alpha, alpha_ma, sinks = inputs
    leaves = [t for t in (q, k, v, alpha, sinks) if t.requires_grad]

    def run(f):
        def go():
            out = f()
            if backward:
                for t in leaves:
                    t.grad = None
                out.backward(torch.ones_like(out))
            return out
        return go

    m = {
        "sdpa": run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)),
        "affine": run(lambda: affine_scaled_attention(q, k, v, alpha, alpha_ma, is_causal=True, enable_gqa=gqa)),
        "sink": run(lambda: sink_attention(q, k, v, sinks, is_causal=True, enable_gqa=gqa)),
    }
    if T <= REFERENCE_MAX_T:
        m["affine_reference"] = run(lambda: affine_scaled_attention_reference(
            q, k, v, alpha, alpha_ma, is_causal=True, enable_gqa=gqa)[0])
        m["sink_reference"] = run(lambda: sink_attention_reference(
            q, k, v, sinks, is_causal=True, enable_gqa=gqa)[0])
    return m


def bench_prefill(args, device):
    rows = []
    for dtype in args.dtypes:
        for hkv in args.kv_heads:
            for T in args.lengths:
                for backward in (False, True):
                    inputs = make_inputs(args.batch, args.heads, hkv, T, args.head_dim, dtype, device, backward)
                    methods = methods_for(inputs, hkv != args.heads, T, backward)
                    ctx = contextlib.nullcontext() if backward else torch.no_grad()
                    with ctx:
                        res = paired_ratios(methods, "sdpa", device, repeats=args.repeats)
                        mem = {}
                        if backward and args.memory:
                            mem = {n: peak_memory_bytes(methods[n], device) for n in ("sdpa", "affine", "sink")}
                    row = {"dtype": str(dtype).replace("torch.", ""), "heads": f"{args.heads}/{hkv}", "T": T,
                           "pass": "fwd+bwd" if backward else "fwd", "sdpa_ms": res["sdpa"]["median_s"] * 1e3}
                    row.update({n: r["ratio"] for n, r in res.items() if n != "sdpa"})
                    row.update({f"mem_{n}": b for n, b in mem.items()})
                    rows.append(row)
                    print(format_row(row), flush=True)
    return rows


def bench_decode(args, device):
    """One decoding step (T = 1 after a cache of S keys): plain SDPA vs affine with a running sum of V (what the
    HF cache keeps) vs affine re-summing the cache; microseconds per step, medians over repeats."""
    out = []
    for S in args.decode_lengths:
        q, k, v, _, alpha_ma, sinks = make_inputs(args.batch, args.heads, args.heads // 4 or 1, S, args.head_dim,
                                                  torch.float32, device, False)
        q1 = q[:, :, -1:].contiguous()
        alpha1 = torch.rand(q1.shape[:3], device=device)
        running = v.float().sum(-2, keepdim=True)  # (B, Hkv, 1, D): maintained incrementally by the cache
        gqa = True
        with torch.no_grad():
            fns = {
                "sdpa": lambda: F.scaled_dot_product_attention(q1, k, v, enable_gqa=gqa),
                "affine_running_sum": lambda: affine_scaled_attention(
                    q1, k, v, alpha1, alpha_ma, is_causal=True, enable_gqa=gqa, v_mean=running / S),
                "affine_resum": lambda: affine_scaled_attention(q1, k, v, alpha1, alpha_ma, is_causal=True,
                                                                enable_gqa=gqa),
                "sink": lambda: sink_attention(q1, k, v, sinks, is_causal=True, enable_gqa=gqa),
            }
            times = {n: [] for n in fns}
            for f in fns.values():
                f()
            for _ in range(args.decode_repeats):
                for n, f in fns.items():
                    times[n].append(time_once(f, device, inner=20))
        med = {n: statistics.median(t) * 1e6 for n, t in times.items()}
        row = {"S": S, **{f"{n}_us": t for n, t in med.items()}}
        row.update({f"{n}_extra_us": med[n] - med["sdpa"] for n in fns if n != "sdpa"})
        out.append(row)
        print(" | ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return out


def format_row(row):
    return " | ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def markdown(rows, decode_rows, device):
    names = ["affine", "sink", "affine_reference", "sink_reference"]
    lines = [f"Device: {device}, threads: {torch.get_num_threads()}, torch {torch.__version__}", "",
             "| dtype | Hq/Hkv | T | pass | SDPA ms | " + " | ".join(f"{n} / SDPA" for n in names)
             + " | peak mem affine / SDPA | peak mem sink / SDPA |",
             "|---|---|---|---|---|" + "---|" * (len(names) + 2)]
    for r in rows:
        ratios = " | ".join(f"{r[n]:.3f}x" if n in r else "—" for n in names)
        mem = " | ".join(f"{r[f'mem_{n}'] / r['mem_sdpa']:.2f}x ({r[f'mem_{n}'] / 2**20:.0f} MiB)"
                         if f"mem_{n}" in r and r["mem_sdpa"] else "—" for n in ("affine", "sink"))
        lines.append(f"| {r['dtype']} | {r['heads']} | {r['T']} | {r['pass']} | {r['sdpa_ms']:.1f} | {ratios} | {mem} |")
    if decode_rows:
        lines += ["", "| cache S | SDPA µs | affine (running sum) extra µs | affine (re-sum cache) extra µs | "
                      "sink extra µs |", "|---|---|---|---|---|"]
        for r in decode_rows:
            lines.append(f"| {r['S']} | {r['sdpa_us']:.1f} | {r['affine_running_sum_extra_us']:+.1f} | "
                         f"{r['affine_resum_extra_us']:+.1f} | {r['sink_extra_us']:+.1f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short smoke run")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2], help="8 = MHA, fewer = GQA")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--decode-lengths", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    p.add_argument("--decode-repeats", type=int, default=15)
    p.add_argument("--no-memory", dest="memory", action="store_false")
    p.add_argument("--out", help="also write the markdown table here")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.dtypes, args.kv_heads, args.repeats = [256, 1024], ["float32"], [2], 3
        args.decode_lengths, args.decode_repeats = [256, 1024], 5
    args.dtypes = [getattr(torch, d) for d in args.dtypes]
    device = torch.device(args.device)
    rows = bench_prefill(args, device)
    decode_rows = bench_decode(args, device)
    table = markdown(rows, decode_rows, device)
    print("\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
