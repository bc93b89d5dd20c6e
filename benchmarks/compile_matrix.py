"""Every public op x every mask under torch.compile(fullgraph=True) against eager, forward and backward, on CPU fp32.

Per cell: whether dynamo traced the call in one graph (or the error type), max |compiled - eager| of the output,
of every gradient (q, k, v and the op's own parameters), and of the output under no_grad (the decoding path, which
skips the autograd nodes). Shapes are deliberately odd (T = 5, 7, 9, 10, 11; D = 6; GQA Hq = 4, Hkv = 2).

    python benchmarks/compile_matrix.py                          # the table on the installed torch (~3 min, 2 cores)
    python benchmarks/compile_matrix.py --json 2.11.json         # ... and its results as JSON
    python benchmarks/compile_matrix.py --merge 2.11.json 2.13.json   # one column per torch version
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from affine_attention.ops import affine_scaled_attention, off_by_one_attention, sink_attention, softmax_attention
from affine_attention.ops.attention import attention_with_epilogue

B, HQ, HKV, D = 2, 4, 2, 6
TOL = 1e-5  # fp32: compiled and eager run the same kernels, so anything above rounding noise is a bug


class Op(NamedTuple):
    """params(T) -> the op's own differentiable inputs by name; call(q, k, v, params, mask kwargs) -> output."""

    params: Callable[[int], dict]
    call: Callable


class Mask(NamedTuple):
    """T queries over S keys; kwargs() -> the mask keyword arguments (tensors built on call: the seed is fixed)."""

    T: int
    S: int
    kwargs: Callable[[], dict]


def _alpha(T):
    return {"alpha": torch.rand(B, HQ, T) * 1.5 + 0.25, "alpha_ma": torch.rand(HQ) + 0.5}


def _gate(T, width):
    return torch.sigmoid(torch.randn(B, HQ, T, width))


OPS: dict[str, Op] = {
    "softmax": Op(lambda T: {}, lambda q, k, v, p, kw: softmax_attention(q, k, v, enable_gqa=True, **kw)),
    "off_by_one": Op(lambda T: {}, lambda q, k, v, p, kw: off_by_one_attention(q, k, v, enable_gqa=True, **kw)),
    "sink": Op(lambda T: {"sinks": torch.randn(HQ)},
               lambda q, k, v, p, kw: sink_attention(q, k, v, p["sinks"], enable_gqa=True, **kw)),
    "affine": Op(_alpha, lambda q, k, v, p, kw: affine_scaled_attention(q, k, v, p["alpha"], p["alpha_ma"],
                                                                        enable_gqa=True, **kw)),
    # The gate paths as the gated variants call them: elementwise with affine, headwise alone.
    "affine_gated": Op(lambda T: {**_alpha(T), "gate": _gate(T, D)},
                       lambda q, k, v, p, kw: attention_with_epilogue(q, k, v, enable_gqa=True, **p, **kw)),
    "gated": Op(lambda T: {"gate": _gate(T, 1)},
                lambda q, k, v, p, kw: attention_with_epilogue(q, k, v, enable_gqa=True, **p, **kw)),
}


def _keypad(S, pads, left):
    """(B, 1, 1, S) bool: row b hides its first (left) or last pads[b] keys."""
    j = torch.arange(S)
    rows = [(j >= p) if left else (j < S - p) for p in pads]
    return torch.stack(rows)[:, None, None, :]


def _dense(T, S):
    """(B, 1, T, S) bool, random, every query keeping at least its own diagonal key."""
    m = torch.rand(B, 1, T, S) < 0.6
    m[..., torch.arange(T), torch.arange(T) % S] = True
    return m


def _documents(S):
    return torch.stack([torch.arange(S) // 4, (torch.arange(S) >= 3).long() + (torch.arange(S) >= 8).long()])


MASKS: dict[str, Mask] = {
    "none": Mask(7, 9, lambda: {}),
    "causal": Mask(7, 7, lambda: {"is_causal": True}),
    "causal T<S (cache)": Mask(5, 11, lambda: {"is_causal": True}),
    "causal T>S": Mask(9, 6, lambda: {"is_causal": True}),
    "keypad left + causal": Mask(7, 7, lambda: {"is_causal": True, "attn_mask": _keypad(7, (0, 3), True)}),
    "keypad right": Mask(7, 9, lambda: {"attn_mask": _keypad(9, (2, 0), False)}),
    "dense (B,1,T,S)": Mask(7, 9, lambda: {"attn_mask": _dense(7, 9)}),
    "window=3": Mask(10, 10, lambda: {"is_causal": True, "window": 3}),
    "document_ids": Mask(10, 10, lambda: {"is_causal": True, "document_ids": _documents(10)}),
    "window=4 + keypad": Mask(10, 10, lambda: {"is_causal": True, "window": 4,
                                                "attn_mask": _keypad(10, (0, 3), True)}),
}

CASES = [(op, mask) for op in OPS for mask in MASKS]


def _inputs(op: str, mask: str, seed: int = 0):
    torch.manual_seed(seed)
    m = MASKS[mask]
    tensors = {"q": torch.randn(B, HQ, m.T, D), "k": torch.randn(B, HKV, m.S, D), "v": torch.randn(B, HKV, m.S, D),
               **OPS[op].params(m.T)}
    kw = m.kwargs()
    weight = torch.randn(B, HQ, m.T, D)  # a random cotangent: a plain .sum() would hide errors that sum to 0
    return tensors, kw, weight


def _run(fn, tensors: dict, weight) -> tuple[torch.Tensor, dict]:
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in tensors.items()}
    out = fn(leaves)
    grads = torch.autograd.grad((out * weight).sum(), list(leaves.values()))
    return out.detach(), dict(zip(leaves, grads))


def _diff(a, b) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def run_cell(op: str, mask: str, backend: str = "aot_eager") -> dict:
    """One cell: {"op", "mask", "traced", "error", "fwd", "grad", "grads", "zero_grads", "nograd"}."""
    tensors, kw, weight = _inputs(op, mask)
    call = OPS[op].call

    def fn(t):
        rest = {n: x for n, x in t.items() if n not in ("q", "k", "v")}
        return call(t["q"], t["k"], t["v"], rest, kw)

    cell = {"op": op, "mask": mask, "traced": False, "error": None}
    ref_out, ref_grads = _run(fn, tensors, weight)
    torch._dynamo.reset()  # every cell compiles from scratch: no recompile limits, no graphs from other cells
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    try:
        out, grads = _run(compiled, tensors, weight)
        with torch.no_grad():
            nograd = _diff(compiled(tensors), fn(tensors))
    except Exception as e:  # noqa: BLE001 (the cell records any failure to trace or run)
        cell["error"] = type(e).__name__
        cell["message"] = (str(e).strip().splitlines() or [""])[0][:200]
        return cell
    finally:
        torch._dynamo.reset()
    per = {n: _diff(grads[n], ref_grads[n]) for n in grads}
    cell.update(traced=True, fwd=_diff(out, ref_out), grad=max(per.values()), grads=per, nograd=nograd,
                zero_grads=[n for n in grads if not grads[n].any() and ref_grads[n].any()])
    return cell


def cell_ok(cell: dict, tol: float = TOL) -> bool:
    return cell["traced"] and max(cell["fwd"], cell["grad"], cell["nograd"]) <= tol


def _fmt(cell: dict | None) -> str:
    if cell is None:
        return "-"
    if not cell["traced"]:
        return f"**no: {cell['error']}**"
    text = " / ".join("0" if x == 0 else f"{x:.0e}" for x in (cell["fwd"], cell["grad"], cell["nograd"]))
    if cell["zero_grads"]:
        text += f" (zero d{', d'.join(cell['zero_grads'])})"
    return text if cell_ok(cell) else f"**{text}**"


def table(results: list[dict]) -> str:
    """Markdown: a row per op x mask, a column per result (torch version)."""
    header = [r.get("label") or f"torch {r['torch']}" for r in results]
    lines = ["| op | mask | " + " | ".join(header) + " |", "|---|---|" + "---|" * len(results)]
    by = [{(c["op"], c["mask"]): c for c in r["cells"]} for r in results]
    keys = list(dict.fromkeys(k for b in by for k in b))
    for op, mask in keys:
        lines.append(f"| {op} | {mask} | " + " | ".join(_fmt(b.get((op, mask))) for b in by) + " |")
    bad = [sum(not cell_ok(c) for c in r["cells"]) for r in results]
    lines.append("")
    lines.append(f"Cells: max |compiled - eager| forward / every gradient / no_grad forward (fp32, "
                 f"{results[0]['backend']}, fullgraph=True); bold = not traced or above {TOL:g}. Failing cells: "
                 + ", ".join(f"{h}: {n} of {len(r['cells'])}" for h, r, n in zip(header, results, bad)) + ".")
    return "\n".join(lines)


def grid(results: list[dict]) -> str:
    """Markdown, compact (the README's form): a row per op, a column per mask; each cell gives, per result (torch
    version, in order), the largest of the three errors, or "no" where fullgraph did not trace."""
    header = [r.get("label") or f"torch {r['torch']}" for r in results]
    by = [{(c["op"], c["mask"]): c for c in r["cells"]} for r in results]
    ops = list(dict.fromkeys(op for b in by for op, _ in b))
    masks = list(dict.fromkeys(mask for b in by for _, mask in b))

    def cell(op, mask):
        parts = []
        for b in by:
            c = b.get((op, mask))
            if c is None:
                parts.append("-")
            elif not c["traced"]:
                parts.append("**no**")
            else:
                worst = max(c["fwd"], c["grad"], c["nograd"])
                text = "0" if worst == 0 else f"{worst:.0e}"
                parts.append(text if cell_ok(c) else f"**{text}**")
        return " / ".join(parts)

    lines = ["| op | " + " | ".join(masks) + " |", "|---|" + "---|" * len(masks)]
    lines += [f"| {op} | " + " | ".join(cell(op, m) for m in masks) + " |" for op in ops]
    bad = [sum(not cell_ok(c) for c in r["cells"]) for r in results]
    lines += ["", f"Each cell: {' / '.join(header)}: the largest |compiled - eager| over the forward, every gradient "
              f"and the no_grad forward (fp32, {results[0]['backend']}, fullgraph=True); no = did not trace; bold = "
              f"above {TOL:g}. Failing cells: " + ", ".join(f"{h}: {n} of {len(r['cells'])}"
                                                           for h, r, n in zip(header, results, bad)) + "."]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write this run's results here")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="print the table of earlier runs, run nothing")
    ap.add_argument("--grid", action="store_true", help="with --merge: the compact op x mask grid (README)")
    ap.add_argument("--label", help="this run's column header in merged tables (default: the torch version)")
    ap.add_argument("--backend", default="aot_eager", help="torch.compile backend (aot_eager, inductor)")
    ap.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS))
    ap.add_argument("--masks", nargs="+", choices=list(MASKS), default=list(MASKS))
    args = ap.parse_args(argv)
    if args.merge:
        results = []
        for path in args.merge:
            with open(path) as f:
                results.append(json.load(f))
            if any(r.get("label") == results[-1].get("label") and r["torch"] == results[-1]["torch"]
                   for r in results[:-1]):  # two runs of one version (before / after a fix): tell them apart
                results[-1]["label"] = f"torch {results[-1]['torch']} ({Path(path).stem})"
        print(grid(results) if args.grid else table(results))
        return 0
    cells = []
    for op in args.ops:
        for mask in args.masks:
            cells.append(run_cell(op, mask, args.backend))
            print(f"{op:13s} {mask:22s} {_fmt(cells[-1])}", file=sys.stderr, flush=True)
    result = {"torch": torch.__version__, "python": platform.python_version(), "backend": args.backend,
              "label": args.label, "cells": cells}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(table([result]))
    return 0 if all(cell_ok(c) for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
