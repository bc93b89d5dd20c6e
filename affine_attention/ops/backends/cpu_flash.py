"""PyTorch's CPU flash kernel (aten `_scaled_dot_product_flash_attention_for_cpu`), which returns its log-sum-exp.

Masks the kernel takes whole (none, causal with T = S, key padding) go in one call. Sliding windows, documents and
queries after a cache (1 < T < S, or T > S) run per block of queries over only the band of keys that block can
see: softmax rows are independent, so each block's (out, lse) is exact and its backward adds into its band of
dk, dv. A block that is one whole document (a square, with no window cut) takes the kernel's own causal flag;
any other block a small (block x band) additive bias. No tensor of T x S elements is built.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..._compat import float_acc
from ..masks import MaskSpec
from .base import Backend, Call

# Queries per banded block: the bias is BLOCK x (BLOCK + window); smaller blocks waste less of the band on masked
# keys, larger ones pay the per-call overhead less often.
BLOCK = 128
# Documents shorter than this on average go through the banded blocks (one kernel call per document would cost
# more in call overhead than it saves).
MIN_DOCUMENT = 64


class Block(NamedTuple):
    """Queries start..stop-1 see at most keys lo..hi-1. whole: the block is one document's square (or all of it
    without causal), so the kernel's causal flag and a key-padding bias express its mask exactly."""

    start: int
    stop: int
    lo: int
    hi: int
    whole: bool = False


def _ops():
    return (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)


def _additive(vis: Tensor, dtype: torch.dtype) -> Tensor:
    """bool visibility -> 0 / -inf bias in the kernel's dtype (it takes no bool mask)."""
    return torch.zeros(vis.shape, dtype=dtype, device=vis.device).masked_fill(~vis, float("-inf"))


def _banded(mask: MaskSpec) -> bool:
    """True when the kernel cannot take the mask in one call without a (T, S) bias."""
    causal_offset = "causal" in mask.kinds and not mask.causal_square
    return causal_offset or bool(mask.kinds & {"window", "documents"})


def _whole_bias(mask: MaskSpec, dtype: torch.dtype) -> tuple[Tensor | None, bool]:
    """Bias and causal flag for a one-call mask: key padding as a (B|1, 1, 1, S) bias the kernel broadcasts."""
    bias = None if mask.keys is None else _additive(mask.keys, dtype)
    return bias, "causal" in mask.kinds


def _bands(mask: MaskSpec, start: int, stop: int, lo: int, hi: int) -> list[Block]:
    """Blocks of BLOCK queries over start..stop-1, each band the shape-only one cut to keys lo..hi-1."""
    out = []
    for a in range(start, stop, BLOCK):
        b = min(stop, a + BLOCK)
        s_lo, s_hi = mask.static_key_range(a, b)
        b_lo, b_hi = max(lo, s_lo), min(hi, s_hi)
        out.append(Block(a, b, b_lo, max(b_lo, b_hi)))
    return out


def _document_plan(mask: MaskSpec) -> list[Block] | None:
    """Blocks aligned to documents shared by every row (None where that does not pay: per-row layouts, short
    documents). One host sync per call for the document lengths."""
    if mask.documents.shape[0] != 1:
        return None
    lengths = torch.unique_consecutive(mask.documents[0], return_counts=True)[1]
    if lengths.numel() * MIN_DOCUMENT > mask.S:
        return None
    plan, end, off = [], 0, mask.offset
    for n in lengths.tolist():
        begin, end = end, end + n
        first = max(begin, off)  # the document's first query position; earlier ones are in the cache
        if first >= end:
            continue
        if first == begin and (mask.window is None or mask.window >= n):
            plan.append(Block(begin - off, end - off, begin, end, whole=True))
        else:
            plan.extend(_bands(mask, first - off, end - off, begin, end))
    return plan


def _plan(mask: MaskSpec, device: torch.device) -> list[Block]:
    """The blocks covering all T queries.

    Causal and window bound each band from the shapes alone; documents narrow it from the ids (a host sync per
    call, skipped under torch.compile, where the wider shape-only band with its bias is still exact).
    """
    if mask.documents is None or torch.compiler.is_compiling():
        return _bands(mask, 0, mask.T, 0, mask.S)
    plan = _document_plan(mask)
    if plan is not None:
        return plan
    plan = _bands(mask, 0, mask.T, 0, mask.S)
    lo, hi = mask.key_ranges(device)  # (Bd, T), non-decreasing along T
    first = torch.tensor([blk.start for blk in plan], device=device)
    last = torch.tensor([blk.stop - 1 for blk in plan], device=device)
    d_lo, d_hi = torch.stack([lo[:, first].amin(0), hi[:, last].amax(0)]).tolist()
    return [Block(blk.start, blk.stop, max(blk.lo, a), max(max(blk.lo, a), min(blk.hi, b)))
            for blk, a, b in zip(plan, d_lo, d_hi)]


def _block_mask(mask: MaskSpec, blk: Block, dtype: torch.dtype, device: torch.device):
    """(bias or None, causal flag, rows that see a key: bool broadcastable to (B, Hq, stop - start) or None)."""
    if blk.whole:
        if mask.keys is None:
            return None, mask.causal, None
        keys = mask.keys[..., blk.lo:blk.hi]  # (B|1, 1, 1, n)
        sees = keys.cumsum(-1)[:, :, 0] > 0 if mask.causal else keys.any(-1)
        return _additive(keys, dtype), mask.causal, sees
    vis = mask.chunk_bool(blk.start, blk.stop, device, blk.lo, blk.hi)
    return _additive(vis, dtype), False, vis.any(-1)


class CpuFlashBackend(Backend):
    name = "cpu_flash"

    def supports(self, call: Call) -> str | None:
        m = call.mask
        if call.device_type != "cpu":
            return f"runs on CPU only (got {call.device_type})"
        if m.S == 0:
            return "no keys (S = 0)"
        if "dense" in m.kinds:
            return "masks ['dense'] (an arbitrary boolean attn_mask)"
        return None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, scale: float) -> tuple[Tensor, Tensor]:
        fwd, _ = _ops()
        if not _banded(mask):
            bias, causal = _whole_bias(mask, q.dtype)
            out, lse = fwd(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
            if mask.keys is not None:
                lse = lse.masked_fill(~mask.keys.any(-1), float("-inf"))  # rows whose keys are all padding
            return out, lse
        B, Hq, T, D = q.shape
        out = q.new_zeros(B, Hq, T, D)
        lse = torch.full((B, Hq, T), float("-inf"), dtype=float_acc(q.dtype), device=q.device)
        for blk in _plan(mask, q.device):
            a, b, lo, hi = blk.start, blk.stop, blk.lo, blk.hi
            if hi == lo:
                continue  # no query of this block sees a key: out 0, lse -inf
            bias, causal, sees = _block_mask(mask, blk, q.dtype, q.device)
            o, l_ = fwd(q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], 0.0, causal, attn_mask=bias, scale=scale)
            out[:, :, a:b] = o
            lse[:, :, a:b] = l_ if sees is None else l_.masked_fill(~sees, float("-inf"))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        _, bwd = _ops()
        # The kernel marks a row that sees nothing with lse 0, not -inf (which would make its exp(s - lse) NaN).
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros((), dtype=lse.dtype, device=lse.device))
        if not _banded(mask):
            bias, causal = _whole_bias(mask, q.dtype)
            return bwd(dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
        acc = float_acc(q.dtype)
        dq = torch.zeros_like(q)
        # Bands overlap between blocks: accumulate dk, dv in float32 so low precision rounds once, not per block.
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for blk in _plan(mask, q.device):
            a, b, lo, hi = blk.start, blk.stop, blk.lo, blk.hi
            if hi == lo:
                continue
            bias, causal, _ = _block_mask(mask, blk, q.dtype, q.device)
            gq, gk, gv = bwd(dout[:, :, a:b], q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], out[:, :, a:b],
                             lse[:, :, a:b], 0.0, causal, attn_mask=bias, scale=scale)
            dq[:, :, a:b] = gq
            dk[:, :, lo:hi] += gk
            dv[:, :, lo:hi] += gv
        return dq, dk.to(k.dtype), dv.to(v.dtype)
