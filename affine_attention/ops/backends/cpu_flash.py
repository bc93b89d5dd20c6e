"""PyTorch's CPU flash kernel (aten `_scaled_dot_product_flash_attention_for_cpu`), which returns its log-sum-exp.

Masks the kernel takes whole (none, causal with T = S, key padding) go in one call. Sliding windows, documents and
queries after a cache (1 < T < S, or T > S) run per block of queries over only the band of keys that block can
see, with a small (block x band) additive bias: softmax rows are independent, so each block's (out, lse) is exact
and its backward adds into its band of dk, dv. No tensor of T x S elements is built.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._compat import float_acc
from ..call import Score
from ..masks import MaskSpec
from .base import Backend, Call, register

# Queries per block on the banded path: the bias is BLOCK x (BLOCK + window) per block; smaller blocks waste
# less of the band on masked keys, larger ones pay the per-call overhead less often.
BLOCK = 128


def _ops():
    # The resolved overloads: calling the packets re-resolves them on every call (on every decoding step).
    return (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


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


def _key_blocks(mask: MaskSpec, device: torch.device) -> list[tuple[int, int, int, int]]:
    """Blocks (start, stop, key_lo, key_hi): queries start..stop-1 see only keys key_lo..key_hi-1; derived once per
    mask object (so once per model forward at the seam, for forward and backward of every layer)."""
    return mask.derived(("cpu_flash.blocks", device), lambda: _blocks(mask, device))


def _blocks(mask: MaskSpec, device: torch.device) -> list[tuple[int, int, int, int]]:
    """See `_key_blocks`. Causal and window bound the band from the shapes alone; documents narrow it further from the
    ids (one host sync, skipped under torch.compile, where the wider shape-only band with its bias is still exact).
    """
    starts = list(range(0, mask.T, BLOCK))
    bands = [mask.static_key_range(a, min(mask.T, a + BLOCK)) for a in starts]
    if mask.documents is not None and not torch.compiler.is_compiling():
        lo, hi = mask.key_ranges(device)  # (Bd, T), non-decreasing along T
        first = torch.tensor(starts, device=device)
        last = (first + BLOCK).clamp(max=mask.T) - 1
        ranges = torch.stack([lo[:, first].amin(0), hi[:, last].amax(0)]).tolist()
        bands = [(max(s_lo, d_lo), min(s_hi, d_hi)) for (s_lo, s_hi), d_lo, d_hi in zip(bands, *ranges)]
    return [(a, min(mask.T, a + BLOCK), lo, max(lo, hi)) for a, (lo, hi) in zip(starts, bands)]


@register
class CpuFlashBackend(Backend):
    name = "cpu_flash"
    priority = 20  # the lse path on CPU
    layout = "last_dim_contiguous"

    def supports(self, call: Call) -> str | None:
        m = call.mask
        if call.device_type != "cpu":
            return f"runs on CPU only (got {call.device_type})"
        if m.S == 0:
            return "no keys (S = 0)"
        if "dense" in m.kinds:
            return "masks ['dense'] (an arbitrary boolean attn_mask)"
        return None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, score: Score) -> tuple[Tensor, Tensor]:
        scale = score.scale
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
        for a, b, lo, hi in _key_blocks(mask, q.device):
            if hi == lo:
                continue  # no query of this block sees a key: out 0, lse -inf
            vis = mask.chunk_bool(a, b, q.device, lo, hi)
            o, l_ = fwd(q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], 0.0, False, attn_mask=_additive(vis, q.dtype),
                        scale=scale)
            out[:, :, a:b] = o
            lse[:, :, a:b] = l_.masked_fill(~vis.any(-1), float("-inf"))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, mask, score):
        scale = score.scale
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
        for a, b, lo, hi in _key_blocks(mask, q.device):
            if hi == lo:
                continue
            bias = _additive(mask.chunk_bool(a, b, q.device, lo, hi), q.dtype)
            gq, gk, gv = bwd(dout[:, :, a:b], q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], out[:, :, a:b],
                             lse[:, :, a:b], 0.0, False, attn_mask=bias, scale=scale)
            dq[:, :, a:b] = gq
            dk[:, :, lo:hi] += gk
            dv[:, :, lo:hi] += gv
        return dq, dk.to(k.dtype), dv.to(v.dtype)
