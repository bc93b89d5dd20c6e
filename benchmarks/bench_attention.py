"""Attention benchmark: each variant's fast path and the reference path, as time ratios to plain SDPA measured in
the same run (forward and forward+backward), peak memory, the cost of one cached decoding step, sliding-window and
packed-document masks (ratios to softmax on the same mask and to plain causal SDPA), and the float32 error of the
affine mean of V under those masks at long S (centred prefix sums vs a naive uncentred prefix difference).

    python benchmarks/bench_attention.py            # full table (tens of minutes on 2 CPU cores)
    python benchmarks/bench_attention.py --quick    # a short smoke run
    python benchmarks/bench_attention.py --only masks prefix_error --lengths 4096   # the structured-mask tables
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import torch
from torch import Tensor
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, median_ratio, paired_ratios, paired_times, peak_memory_bytes, time_once  # noqa: E402

from affine_attention.ops import (  # noqa: E402
    affine_scaled_attention, affine_scaled_attention_reference, sink_attention, sink_attention_reference,
    softmax_attention,
)
from affine_attention.ops.masks import parse_mask
from affine_attention.ops.visible_sums import visible_sum_and_count  # noqa: E402

SECTIONS = ("prefill", "decode", "masks", "prefix_error")
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


def structured_masks(T: int, window: int, documents: int) -> dict[str, dict]:
    """The op keywords of each structured mask benchmarked: a sliding window and equal packed documents."""
    return {f"window {window}": dict(is_causal=True, window=window),
            f"{documents} documents": dict(is_causal=True, document_ids=(torch.arange(T) * documents // T)[None])}


def bench_masks(args, device):
    """Forward+backward under each structured mask: affine and sink as ratios to softmax on the same mask and to
    plain causal SDPA (no window, no documents), all timed in the same repeats."""
    rows = []
    for dtype in args.dtypes:
        for hkv in args.kv_heads:
            for T in args.lengths:
                q, k, v, alpha, alpha_ma, sinks = make_inputs(args.batch, args.heads, hkv, T, args.head_dim, dtype,
                                                              device, True)
                gqa = hkv != args.heads
                leaves = (q, k, v, alpha, sinks)

                def fwd_bwd(f):
                    def go():
                        for t in leaves:
                            t.grad = None
                        out = f()
                        out.backward(torch.ones_like(out))
                    return go

                methods = {"sdpa": fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                   enable_gqa=gqa))}
                masks = structured_masks(T, args.window, args.documents)
                for name, kw in masks.items():
                    methods[f"softmax|{name}"] = fwd_bwd(lambda kw=kw: softmax_attention(q, k, v, enable_gqa=gqa, **kw))
                    methods[f"affine|{name}"] = fwd_bwd(lambda kw=kw: affine_scaled_attention(
                        q, k, v, alpha, alpha_ma, enable_gqa=gqa, **kw))
                    methods[f"sink|{name}"] = fwd_bwd(lambda kw=kw: sink_attention(q, k, v, sinks, enable_gqa=gqa,
                                                                                   **kw))
                times = paired_times(methods, device, args.repeats)
                for name in masks:
                    row = {"dtype": str(dtype).replace("torch.", ""), "heads": f"{args.heads}/{hkv}", "T": T,
                           "mask": name, "sdpa_ms": statistics.median(times["sdpa"]) * 1e3,
                           "softmax_ms": statistics.median(times[f"softmax|{name}"]) * 1e3}
                    for op in ("softmax", "affine", "sink"):
                        row[f"{op}/sdpa"] = median_ratio(times, f"{op}|{name}", "sdpa")
                    for op in ("affine", "sink"):
                        row[f"{op}/softmax"] = median_ratio(times, f"{op}|{name}", f"softmax|{name}")
                    rows.append(row)
                    print(format_row(row), flush=True)
    return rows


def _naive_mean(v: Tensor, mask) -> Tensor:
    """The uncentred form: one prefix sum over all of S, differenced at each query's key range (B = 1)."""
    lo, hi = (r[0] for r in mask.key_ranges(v.device))
    prefix = torch.cat([torch.zeros_like(v[:, :, :1]), v.cumsum(2)], dim=2)
    return (prefix[:, :, hi] - prefix[:, :, lo]) / (hi - lo).clamp(min=1)[None, None, :, None].to(v.dtype)


def bench_prefix_error(args):
    """Max |float32 - float64| of the affine mean of V (B = 1, one head, D = head_dim) under each structured mask,
    centred (the library) vs uncentred, for V = N(0, 1) + offset: a common offset is what makes prefix sums drift."""
    rows = []
    for S in args.error_lengths:
        g = torch.Generator().manual_seed(0)
        base = torch.randn(1, 1, S, args.head_dim, generator=g, dtype=torch.float64)
        for offset in args.error_offsets:
            v = base + offset
            for name, kw in structured_masks(S, args.window, args.documents).items():
                mask = parse_mask(None, True, 1, 1, S, S, v.device, window=kw.get("window"),
                                  document_ids=kw.get("document_ids"))
                with torch.no_grad():
                    t64, c64 = visible_sum_and_count(v, mask, 1)
                    t32, c32 = visible_sum_and_count(v.float(), mask, 1)
                    exact = t64 / c64
                    row = {"S": S, "offset": offset, "mask": name,
                           "centred": ((t32 / c32).double() - exact).abs().max().item(),
                           "uncentred": (_naive_mean(v.float(), mask).double() - exact).abs().max().item()}
                rows.append(row)
                print(" | ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
    return rows


def format_row(row):
    return " | ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def markdown_masks(rows, error_rows):
    lines = []
    if rows:
        lines += ["", "| dtype | Hq/Hkv | T | mask (fwd+bwd) | causal SDPA ms | softmax ms | softmax / SDPA | "
                      "affine / softmax | sink / softmax | affine / SDPA | sink / SDPA |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['dtype']} | {r['heads']} | {r['T']} | {r['mask']} | {r['sdpa_ms']:.1f} | "
                         f"{r['softmax_ms']:.1f} | {r['softmax/sdpa']:.3f}x | {r['affine/softmax']:.3f}x | "
                         f"{r['sink/softmax']:.3f}x | {r['affine/sdpa']:.3f}x | {r['sink/sdpa']:.3f}x |")
    if error_rows:
        lines += ["", "| S | V offset | mask | max abs error of the float32 mean, centred | uncentred |",
                  "|---|---|---|---|---|"]
        for r in error_rows:
            lines.append(f"| {r['S']} | {r['offset']:g} | {r['mask']} | {r['centred']:.1e} | {r['uncentred']:.1e} |")
    return lines


def markdown(rows, decode_rows, device, mask_rows=(), error_rows=()):
    names = ["affine", "sink", "affine_reference", "sink_reference"]
    lines = [f"Device: {device}, threads: {torch.get_num_threads()}, torch {torch.__version__}"]
    if rows:
        lines += ["", "| dtype | Hq/Hkv | T | pass | SDPA ms | " + " | ".join(f"{n} / SDPA" for n in names)
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
    return "\n".join(lines + markdown_masks(mask_rows, error_rows))


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
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice); 1 keeps a loaded "
                   "machine's descheduled worker threads from stalling every parallel region")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run")
    p.add_argument("--window", type=int, default=512, help="sliding window of the structured-mask rows")
    p.add_argument("--documents", type=int, default=8, help="equal packed documents of the structured-mask rows")
    p.add_argument("--error-lengths", type=int, nargs="+", default=[4096, 32768, 131072])
    p.add_argument("--error-offsets", type=float, nargs="+", default=[0.0, 3.0])
    p.add_argument("--out", help="also write the markdown table here")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.dtypes, args.kv_heads, args.repeats = [256, 1024], ["float32"], [2], 3
        args.decode_lengths, args.decode_repeats = [256, 1024], 5
        args.window, args.documents, args.error_lengths = 128, 4, [4096]
    args.dtypes = [getattr(torch, d) for d in args.dtypes]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = bench_prefill(args, device) if "prefill" in args.only else []
    decode_rows = bench_decode(args, device) if "decode" in args.only else []
    mask_rows = bench_masks(args, device) if "masks" in args.only else []
    error_rows = bench_prefix_error(args) if "prefix_error" in args.only else []
    emit(markdown(rows, decode_rows, device, mask_rows, error_rows), args.out)


if __name__ == "__main__":
    main()
