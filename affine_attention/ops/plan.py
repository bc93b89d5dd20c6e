"""What an attention call decides from its arguments alone: their checks, the kernel backend and the epilogue
implementation, for a mask parsed once (per op call, or per model forward at the transformers seam)."""
from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from . import backends, epilogue
from ._validate import check_bias_norm, check_qkv, check_scale
from .backends import Backend, Call
from .masks import MaskSpec, mask_of_call


class Plan(NamedTuple):
    """The call as the backends see it (its sizes, dtype, device and parsed mask), its scale, and the kernel backend
    and epilogue implementation chosen for it."""

    call: Call
    scale: float
    backend: Backend
    epilogue: str


def make_plan(q: Tensor, k: Tensor, v: Tensor, *, mask: MaskSpec | None, attn_mask: Tensor | None, is_causal: bool,
              window: int | None, document_ids: Tensor | None, scale: float | None, bias_norm: str,
              enable_gqa: bool, backend: str | None, needs_lse: bool, epilogue_impl: str | None) -> Plan:
    """Check the arguments (ValueError naming the bad one) and decide. The mask comes either parsed (`mask`, from
    `parse_mask` or the transformers seam) or as the op keywords attn_mask / is_causal / window / document_ids."""
    B, Hq, _, T, S, D = check_qkv(q, k, v, enable_gqa)
    check_bias_norm(bias_norm)
    scale = check_scale(scale, D)
    mask = mask_of_call(mask, attn_mask, is_causal, window, document_ids, B, Hq, T, S, q.device)
    call = Call.of(q, k, mask, needs_lse)
    return Plan(call, scale, backends.select(call, backend), epilogue.select_impl(q.device, epilogue_impl))
