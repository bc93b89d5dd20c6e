"""Running float32 sum of the visible values per cache layer, so each decoding step of the affine variant costs
O(D) for the mean of V instead of re-summing the whole cache.

The state lives beside the transformers cache (a weak dictionary keyed by the cache layer object), never inside
it. It is trusted only while the layer still holds the exact `values` tensor it summed: every cache operation
(append, beam reorder, crop, batch repeat or select, reset, offload) replaces that tensor, so any of them makes
the next step rebuild the sum from the cache, exactly, instead of silently using a stale one. Only plain
`DynamicLayer`s get a running sum; other layer kinds (static, sliding window, quantized) are averaged from the
cache by the op itself, which is exact.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from .._compat import float_acc


@dataclass
class _ValueSum:
    total: Tensor  # (B, Hkv, 1, D) float32: sum of the visible values of the cached positions
    count: Tensor  # (B|1, 1, 1, 1) float32: number of visible cached positions
    keys: Tensor | None  # (B|1, S) bool key mask the sum was taken under; None = every key visible
    values: weakref.ref  # the layer's `values` tensor right after the step that produced this sum
    trusted: bool = False  # set by the attention pre-hook when the layer still holds exactly `values`


_STATES: "weakref.WeakKeyDictionary[object, _ValueSum]" = weakref.WeakKeyDictionary()


def _layer(cache, layer_idx: int):
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    return layers[layer_idx]


@torch.compiler.disable
def before_update(cache, layer_idx: int) -> None:
    """Called before the attention layer appends to the cache: trust the sum only if nothing replaced the values."""
    layer = _layer(cache, layer_idx)
    state = _STATES.get(layer) if layer is not None else None
    if state is not None:
        state.trusted = state.values() is not None and state.values() is getattr(layer, "values", None)


def _same_keys(old: Tensor | None, new: Tensor | None, P: int) -> bool:
    """Whether the cached positions had the same visibility when they were summed (masks may change between calls)."""
    if old is None or new is None:
        return old is None and new is None
    return old.shape[0] == new.shape[0] and old.shape[-1] == P and torch.equal(old, new[:, :P])


def _sum_cached(past: Tensor, km: Tensor | None) -> tuple[Tensor, Tensor]:
    """past: (B, Hkv, P, D), km: (B|1, 1, P, 1) or None -> (sum (B, Hkv, 1, D), count (B|1, 1, 1, 1)) in float32."""
    acc = float_acc(past.dtype)
    past = past.to(acc)
    if km is None:
        return past.sum(-2, keepdim=True), torch.full((1, 1, 1, 1), float(past.shape[-2]), dtype=acc,
                                                      device=past.device)
    return (past * km).sum(-2, keepdim=True), km.sum(-2, keepdim=True)


@torch.compiler.disable
def value_mean(cache, layer_idx: int, value: Tensor, keys: Tensor | None, T: int, bias_norm: str) -> Tensor | None:
    """Mean of the visible values for the last T queries, or None when the op should average the cache itself.

    value: (B, Hkv, S, D), the layer's whole cache after this step's update; keys: (B|1, S) bool key mask or None
    (causal rule on top, bottom-right aligned: query i sees cache positions <= S - T + i). Returns (B, Hkv, T, D)
    float32 following `bias_norm` ("visible": divide by the visible count; "full": by S).
    """
    from transformers.cache_utils import DynamicLayer  # not at import: see _autoload

    layer = _layer(cache, layer_idx)
    if type(layer) is not DynamicLayer or layer.values is not value:
        return None
    if torch.is_grad_enabled() and value.requires_grad:
        return None  # a stored sum would cut the autograd graph across steps; the op's exact path keeps it
    acc = float_acc(value.dtype)
    B, Hkv, S, D = value.shape
    P = S - T
    km = None if keys is None else keys.to(acc)[:, None, :, None]  # (B|1, 1, S, 1)
    state = _STATES.get(layer)
    if state is not None and state.trusted and state.total.shape[0] == B and _same_keys(state.keys, keys, P):
        base_total, base_count = state.total, state.count
    else:  # first step, or the cache changed under us: rebuild from the cache (exact, O(S * D) once)
        base_total, base_count = _sum_cached(value[:, :, :P], None if km is None else km[:, :, :P])
    new = value[:, :, P:].to(acc)  # (B, Hkv, T, D)
    if km is not None:
        new = new * km[:, :, P:]
        new_count = km[:, :, P:].cumsum(-2)  # (B|1, 1, T, 1)
    else:
        new_count = torch.arange(1, T + 1, dtype=acc, device=value.device)[None, None, :, None]
    total = base_total + new.cumsum(-2)  # (B, Hkv, T, D): query i sees every cached position up to P + i
    count = base_count + new_count
    _STATES[layer] = _ValueSum(total[:, :, -1:].detach(), count[:, :, -1:].detach(),
                               None if keys is None else keys, weakref.ref(layer.values))
    denom = count if bias_norm == "visible" else torch.full_like(count, float(S))
    return total / denom.clamp(min=1)
