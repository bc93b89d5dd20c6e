"""What an attention call decides from its arguments alone (their checks, the parsed mask, the kernel backend, the
epilogue implementation), decided once per distinct call: every layer of a model forward makes the same call, so a
decoding step checks and chooses once per forward, not once per layer."""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import Tensor

from . import backends, epilogue
from ._memo import MISS, TensorMemo
from ._validate import check_bias_norm, check_qkv, check_scale
from .backends import Backend, Call
from .masks import parse_mask


class Plan(NamedTuple):
    """The call as the backends see it (its sizes, dtype, device and parsed mask), its scale, and the kernel backend
    and epilogue implementation chosen for it."""

    call: Call
    scale: float
    backend: Backend
    epilogue: str


def make_plan(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None, is_causal: bool, scale: float | None,
              bias_norm: str, enable_gqa: bool, window: int | None, document_ids: Tensor | None,
              backend: str | None, needs_lse: bool, epilogue_impl: str | None) -> Plan:
    """Check the arguments (ValueError naming the bad one) and decide; arguments as `attention_with_epilogue`."""
    B, Hq, _, T, S, D = check_qkv(q, k, v, enable_gqa)
    check_bias_norm(bias_norm)
    scale = check_scale(scale, D)
    mask = parse_mask(attn_mask, is_causal, B, Hq, T, S, q.device, window=window, document_ids=document_ids)
    call = Call.of(q, k, mask, needs_lse)
    return Plan(call, scale, backends.select(call, backend), epilogue.select_impl(q.device, epilogue_impl))


# Calls without mask tensors, keyed by everything make_plan reads; calls with a small mask tensor (a key mask or
# document ids, both O(B * S)) through TensorMemo, which also keys on that tensor's identity and version. Dense
# masks are never kept: the plan holds its mask, and a (B, 1, T, S) one can be large.
_SHAPE_PLANS: OrderedDict = OrderedDict()
_TENSOR_PLANS = TensorMemo(8)
_SIZE = 8


def plan(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None, is_causal: bool, scale: float | None,
         bias_norm: str, enable_gqa: bool, window: int | None, document_ids: Tensor | None, backend: str | None,
         needs_lse: bool, epilogue_impl: str | None) -> Plan:
    """`make_plan`, remembered for the few most recent distinct calls (eager mode only: a compiled graph plans
    once at trace time anyway, and dynamo must not trace a dict keyed by tensor identities)."""
    def made() -> Plan:
        return make_plan(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, bias_norm=bias_norm,
                         enable_gqa=enable_gqa, window=window, document_ids=document_ids, backend=backend,
                         needs_lse=needs_lse, epilogue_impl=epilogue_impl)

    tensor = attn_mask if attn_mask is not None else document_ids
    if torch.compiler.is_compiling() or not _rememberable(q, k, v, attn_mask, document_ids):
        return made()
    # The types of the scalars too: True == 1 and 1 == 1.0 hash alike, but only some of them are valid.
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, type(is_causal),
           is_causal, type(window), window, type(scale), scale, bias_norm, enable_gqa, backend,
           backends.forced_name(), epilogue_impl, epilogue.forced_name(), needs_lse,
           torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
    try:
        hit = _TENSOR_PLANS.get(tensor, *key) if tensor is not None else _SHAPE_PLANS.get(key, MISS)
    except TypeError:  # an unhashable argument: make_plan names what is wrong with it
        return made()
    if hit is not MISS:
        return hit
    result = made()
    if tensor is not None:
        return _TENSOR_PLANS.put(tensor, result, *key)
    _SHAPE_PLANS[key] = result
    if len(_SHAPE_PLANS) > _SIZE:
        try:  # the oldest: decoding makes a new S every step (one C call: another thread may evict too)
            _SHAPE_PLANS.popitem(last=False)
        except KeyError:
            pass
    return result


def _rememberable(q, k, v, attn_mask, document_ids) -> bool:
    """Tensors q, k, v, and at most one small mask tensor: a (B|1, 1, 1, S) key mask or document ids."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return False
    if attn_mask is not None:
        return (document_ids is None and isinstance(attn_mask, Tensor) and attn_mask.dim() == 4
                and attn_mask.shape[1] == 1 and attn_mask.shape[2] == 1)
    return document_ids is None or isinstance(document_ids, Tensor)
