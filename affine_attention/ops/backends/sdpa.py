"""torch SDPA: the fastest path where it fits (no mask, or causal with T == S, or one decoding query); no lse."""
from __future__ import annotations

from torch import Tensor
from torch.nn import functional as F

from ..masks import MaskSpec
from .base import Backend, Call


class SdpaBackend(Backend):
    """F.scaled_dot_product_attention, differentiable by itself. Serves no call that needs an lse (sinks), and only
    masks whose top-left causal alignment equals this library's bottom-right one."""

    name = "sdpa"
    has_lse = False

    def supports(self, call: Call) -> str | None:
        m = call.mask
        if call.needs_lse:
            return "SDPA returns no log-sum-exp (needed for sinks)"
        if m.S == 0:
            return "no keys (S = 0)"
        if m.kinds - {"causal"}:
            return f"masks {sorted(m.kinds - {'causal'})} (only none or causal)"
        if m.causal and not (m.causal_square or m.causal_is_trivial):
            return "causal with 1 < T < S (SDPA aligns causal top-left)"
        return None

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, scale: float) -> Tensor:
        causal = mask.causal and not mask.causal_is_trivial
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
