"""torch SDPA: the fastest path where it fits (no mask, or causal with T == S, or one decoding query); no lse.

On CUDA it runs restricted to the flash, memory-efficient and math kernels: torch 2.11 prefers cuDNN attention on
H100/H200, which has open NaN-gradient and wrong-output bugs, and this library promises never to use it.
"""
from __future__ import annotations

from torch import Tensor
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..call import Score
from ..masks import MaskSpec
from .base import Backend, Call, register

#: The SDPA kernels allowed on CUDA (torch tries them in its own order of preference).
CUDA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _restricted(q: Tensor) -> bool:
    """Whether this call runs with SDPA restricted to CUDA_KERNELS (CUDA only: elsewhere there is no cuDNN)."""
    return q.device.type == "cuda"


@register
class SdpaBackend(Backend):
    """F.scaled_dot_product_attention, differentiable by itself. Serves no call that needs an lse (sinks), and only
    masks whose top-left causal alignment equals this library's bottom-right one."""

    name = "sdpa"
    priority = 40  # fastest where it applies: no lse, differentiable by itself
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

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, score: Score) -> Tensor:
        scale = score.scale
        causal = mask.causal and not mask.causal_is_trivial
        gqa = q.shape[1] != k.shape[1]
        if not _restricted(q):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        with sdpa_kernel(CUDA_KERNELS):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
