"""Running float32 sum of the visible values per cache layer, so each decoding step of the affine variant costs
O(D) for the mean of V instead of re-summing the whole cache.

The state lives on the transformers cache layer object itself (attributes `_affine_vsum`, `_affine_vcount`,
`_affine_keys`, `_affine_vsrc`), so torch.compile traces it like the cache's own tensors: no
`torch.compiler.disable`, no side table. It is trusted only while the layer still holds the exact `values` tensor
it summed: every cache operation (append, beam reorder, crop, batch repeat or select, reset, offload) replaces that
tensor, so any of them makes the next step rebuild the sum from the cache, exactly, instead of silently using a
stale one. Only plain `DynamicLayer`s get a running sum. Static layers are written in place (so identity cannot
tell a crop or reset) and decode under a (B, 1, 1, max_cache_len) key mask: for them the op averages the cache
itself, exactly and statelessly, which also compiles (fixed shapes). Sliding-window and quantized layers likewise.

The same layers keep, under the same rule, which heads hold a non-finite key or value row (`nonfinite_heads`), so a
decoding step tests only the rows it appends, not the whole cache, for the op's NaN isolation.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .._compat import as_dtype, float_acc

_SUM, _COUNT, _KEYS, _SRC = "_affine_vsum", "_affine_vcount", "_affine_keys", "_affine_vsrc"
# Which heads of the layer hold a non-finite key or value row, and the (keys, values) tensors that record is of.
_NONFINITE, _KV_SRC = "_affine_nonfinite", "_affine_kv_src"


def _layer(cache, layer_idx: int):
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    return layers[layer_idx]


def before_update(cache, layer_idx: int) -> bool:
    """Called before the attention layer appends to the cache: whether the layer still holds exactly the values
    its running sum was taken from (nothing replaced them since). Pure: the answer travels as an argument."""
    layer = _layer(cache, layer_idx)
    src = getattr(layer, _SRC, None)
    return src is not None and src is getattr(layer, "values", None)


def kv_before_update(cache, layer_idx: int) -> bool:
    """Like `before_update`, for the non-finite record: whether the layer still holds exactly the keys and values
    that record was taken from."""
    layer = _layer(cache, layer_idx)
    src = getattr(layer, _KV_SRC, None)
    return src is not None and src[0] is getattr(layer, "keys", None) and src[1] is getattr(layer, "values", None)


def nonfinite_heads(cache, layer_idx: int, key: Tensor, value: Tensor, T: int, trusted: bool) -> Tensor | bool | None:
    """(B, Hkv) bool: the heads of this layer's cache that hold a non-finite key or value row; False when none does
    (eager CPU, where asking is cheap); None where the op must test the rows itself (not a plain DynamicLayer, or the
    layer no longer holds these tensors).

    key, value: (B, Hkv, S, D), the layer's whole cache after this step's update; trusted: `kv_before_update`. Kept
    on the cache layer and updated from the T rows each step appends (O(T * D) instead of the op's O(S * D) test);
    rebuilt from the whole cache when anything replaced it (crop, reorder, reset)."""
    from transformers.cache_utils import DynamicLayer  # on first use: importing this module stays cheap

    layer = _layer(cache, layer_idx)
    if type(layer) is not DynamicLayer or layer.keys is not key or layer.values is not value or \
            (key.requires_grad or value.requires_grad) and torch.is_grad_enabled():
        return None  # (holding tensors that require grad would keep their autograd graph alive across steps)
    B, Hkv, S, _ = key.shape
    old = getattr(layer, _NONFINITE, None) if trusted else None
    incremental = old is False or (isinstance(old, Tensor) and old.shape == (B, Hkv))
    k, v = (key[:, :, S - T:], value[:, :, S - T:]) if incremental else (key, value)
    eager_cpu = key.device.type == "cpu" and not torch.compiler.is_compiling()
    if eager_cpu and not isinstance(old, Tensor) and math.isfinite((k.sum() + v.sum()).item()):
        bad = False  # the common case, in a few small ops (a nan or inf makes the sum non-finite; an overflow of
        # finite rows only sends it on to the exact test below)
    else:
        bad = (~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))).any(-1)  # (B, Hkv)
        if isinstance(old, Tensor) and incremental:
            bad = bad | old
    setattr(layer, _NONFINITE, bad)
    setattr(layer, _KV_SRC, (key, value))
    return bad


def _same_keys(old: Tensor | None, new: Tensor | None, P: int, memo: dict | None) -> bool:
    """Whether the cached positions had the same visibility when they were summed (masks may change between calls).

    Shapes decide at trace time. Values: eager compares them once per model forward (every layer asks about the same
    pair of mask objects; `memo` is that forward's dict, see packing.FORWARD_KWARG); a compiled graph cannot branch
    on them, so it asserts them on the device instead (a changed padding of cached positions fails loudly there,
    never silently)."""
    if old is None or new is None:
        return old is None and new is None
    if old.shape[0] != new.shape[0] or old.shape[-1] != P:
        return False
    if torch.compiler.is_compiling():
        torch._assert_async(torch.eq(old, new[:, :P]).all(),
                            "affine_attention: the attention mask of already cached positions changed between "
                            "decoding steps of a compiled model; pass the same mask prefix (as generate does)")
        return True
    key = ("cache.same_keys", id(old), id(new), P)
    hit = memo.get(key) if memo is not None else None
    # The memo holds both masks: their ids cannot be reused while it lives (one forward).
    if hit is not None and hit[0] is old and hit[1] is new:
        return hit[2]
    same = torch.equal(old, new[:, :P])
    if memo is not None:
        memo[key] = (old, new, same)
    return same


def _sum_cached(past: Tensor, km: Tensor | None) -> tuple[Tensor, Tensor]:
    """past: (B, Hkv, P, D), km: (B|1, 1, P, 1) or None -> (sum (B, Hkv, 1, D), count (B|1, 1, 1, 1)) in float32."""
    acc = float_acc(past.dtype)
    past = past.to(acc)
    if km is None:
        return past.sum(-2, keepdim=True), torch.full((1, 1, 1, 1), float(past.shape[-2]), dtype=acc,
                                                      device=past.device)
    return (past * km).sum(-2, keepdim=True), km.sum(-2, keepdim=True)


def value_mean(cache, layer_idx: int, value: Tensor, keys: Tensor | None, T: int, norm: str,
               trusted: bool, memo: dict | None = None) -> Tensor | None:
    """Mean of the visible values for the last T queries, or None when the op should average the cache itself.

    value: (B, Hkv, S, D), the layer's whole cache after this step's update; keys: (B|1, S) bool key mask or None
    (causal rule on top, bottom-right aligned: query i sees cache positions <= S - T + i); trusted: what
    `before_update` said; memo: the forward's memo dict (or None). Returns (B, Hkv, T, D) float32 following
    `norm`, the variant's `value_mean_norm` ("visible": divide by the visible count; "full": by S).
    """
    from transformers.cache_utils import DynamicLayer  # on first use: importing this module stays cheap

    layer = _layer(cache, layer_idx)
    if type(layer) is not DynamicLayer or layer.values is not value:
        return None
    if torch.is_grad_enabled() and value.requires_grad:
        return None  # a stored sum would cut the autograd graph across steps; the op's exact path keeps it
    acc = float_acc(value.dtype)
    B, Hkv, S, D = value.shape
    P = S - T
    total = getattr(layer, _SUM, None)
    if trusted and total is not None and total.shape[0] == B and _same_keys(getattr(layer, _KEYS), keys, P, memo):
        base_total, base_count = total, getattr(layer, _COUNT)
    else:  # first step, or the cache changed under us: rebuild from the cache (exact, O(S * D) once)
        km = None if keys is None else keys[:, None, :P, None].to(acc)  # (B|1, 1, P, 1)
        base_total, base_count = _sum_cached(value[:, :, :P], km)
    new = as_dtype(value[:, :, P:], acc)  # (B, Hkv, T, D)
    if T == 1:  # the decode hot path: O(D), three small ops (each call runs per layer per token)
        if keys is None:
            total, count = base_total + new, base_count + 1.0
        else:
            last = keys[:, None, P:, None].to(acc)  # (B|1, 1, 1, 1)
            total, count = torch.addcmul(base_total, new, last), base_count + last
        last_total, last_count = total, count  # one position long already, and outside any autograd graph
    else:
        if keys is None:
            new_count = torch.arange(1, T + 1, dtype=acc, device=value.device)[None, None, :, None]
        else:
            km = keys[:, None, P:, None].to(acc)  # (B|1, 1, T, 1)
            new, new_count = new * km, km.cumsum(-2)
        total = base_total + new.cumsum(-2)  # (B, Hkv, T, D): query i sees every cached position up to P + i
        count = base_count + new_count
        last_total, last_count = total[:, :, -1:].detach(), count[:, :, -1:].detach()
    setattr(layer, _SUM, last_total)
    setattr(layer, _COUNT, last_count)
    setattr(layer, _KEYS, keys)
    setattr(layer, _SRC, layer.values)
    if norm != "visible":
        return total / float(max(S, 1))
    # Without key padding every query sees at least its own key: no clamp needed.
    return total / (count if keys is None else count.clamp(min=1))
