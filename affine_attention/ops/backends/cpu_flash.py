"""PyTorch's CPU flash kernel (aten `_scaled_dot_product_flash_attention_for_cpu`), which returns its log-sum-exp."""
from __future__ import annotations

import torch
from torch import Tensor

from ..masks import MaskSpec
from .base import Backend, Call


def _ops():
    return (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)


def _bias(mask: MaskSpec, dtype: torch.dtype, device: torch.device) -> tuple[Tensor | None, bool]:
    """The additive bias and causal flag the kernel takes for `mask` (it aligns causal top-left).

    Key padding becomes a (B|1, 1, 1, S) bias that the kernel broadcasts. Queries after a cache (1 < T < S) get
    the bottom-right causal rule as a (T, S) bias. Decoding (T == 1) and training (T == S) never build one.
    """
    bias = None
    if mask.keys is not None:
        bias = torch.zeros(mask.keys.shape, dtype=dtype, device=device).masked_fill(~mask.keys, float("-inf"))
    causal = mask.causal and not mask.causal_is_trivial
    if causal and not mask.causal_square:
        cb = torch.zeros(mask.T, mask.S, dtype=dtype, device=device)
        cb = cb.masked_fill(~mask.causal_bool(device), float("-inf"))[None, None]
        bias = cb if bias is None else bias + cb
        causal = False
    return bias, causal


class CpuFlashBackend(Backend):
    name = "cpu_flash"

    def supports(self, call: Call) -> str | None:
        m = call.mask
        if call.device_type != "cpu":
            return f"runs on CPU only (got {call.device_type})"
        if m.S == 0:
            return "no keys (S = 0)"
        if m.kinds & {"window", "documents", "dense"}:
            return f"masks {sorted(m.kinds & {'window', 'documents', 'dense'})}"
        return None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, scale: float) -> tuple[Tensor, Tensor]:
        fwd, _ = _ops()
        bias, causal = _bias(mask, q.dtype, q.device)
        out, lse = fwd(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        _, bwd = _ops()
        bias, causal = _bias(mask, q.dtype, q.device)
        return bwd(dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
