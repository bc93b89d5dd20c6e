"""Mask normalisation: turns (attn_mask, is_causal) into a structured form the fast paths use without T x S tensors."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class MaskSpec:
    """Which keys each query may see.

    causal: bottom-right aligned (query i sees keys j <= i + S - T), as cached decoding needs;
      torch SDPA aligns top-left, which is wrong once queries follow a cache.
    keys: (B|1, 1, 1, S) bool, a key-only mask (padding); None if absent.
    dense: bool broadcastable to (B, Hq, T, S), any other mask; None if absent. Forces the exact slow paths.
    """

    T: int
    S: int
    causal: bool
    keys: Tensor | None
    dense: Tensor | None

    @property
    def offset(self) -> int:
        return self.S - self.T

    @property
    def causal_is_trivial(self) -> bool:
        """True when the causal mask hides nothing (a single query after its whole cache)."""
        return self.causal and self.T == 1 and self.S >= 1

    @property
    def causal_square(self) -> bool:
        """True when bottom-right and top-left alignment coincide, so any causal kernel is right."""
        return self.causal and self.T == self.S

    def causal_bool(self, device: torch.device) -> Tensor:
        """(T, S) bool: query i sees key j iff j <= i + S - T."""
        i = torch.arange(self.T, device=device)[:, None]
        j = torch.arange(self.S, device=device)[None, :]
        return j <= i + self.offset

    def dense_bool(self, device: torch.device) -> Tensor:
        """Everything combined as one bool mask broadcastable to (B, Hq, T, S); used only on exact slow paths."""
        m = torch.ones(1, 1, self.T, self.S, dtype=torch.bool, device=device)
        if self.causal:
            m = m & self.causal_bool(device)
        if self.keys is not None:
            m = m & self.keys
        if self.dense is not None:
            m = m & self.dense
        return m


def parse_mask(attn_mask: Tensor | None, is_causal: bool, B: int, Hq: int, T: int, S: int,
               device: torch.device) -> MaskSpec:
    """Validate attn_mask (bool, broadcastable to (B, Hq, T, S), True = may attend) and classify it."""
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
    if attn_mask is None:
        return MaskSpec(T, S, is_causal, None, None)
    if not isinstance(attn_mask, Tensor):
        raise ValueError(f"attn_mask must be a bool tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool:
        raise ValueError(
            f"attn_mask must be a boolean tensor (True = may attend), got dtype {attn_mask.dtype}; "
            "convert an additive float mask with `attn_mask = additive_mask > float('-inf')`")
    if attn_mask.dim() > 4 or attn_mask.dim() < 1:
        raise ValueError(f"attn_mask must have rank 1..4, broadcastable to (B, Hq, T, S) = {(B, Hq, T, S)}, "
                         f"got shape {tuple(attn_mask.shape)}")
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    for size, want, name in zip(m.shape, (B, Hq, T, S), ("B", "Hq", "T", "S")):
        if size != 1 and size != want:  # not `in (1, want)`: dynamo misreads `in` on SymInts
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, Hq, T, S) = "
                             f"{(B, Hq, T, S)}: its {name} dimension is {size}, expected 1 or {want}")
    if m.device != device:
        raise ValueError(f"attn_mask is on {m.device} but q is on {device}")
    if m.shape[1] == 1 and m.shape[2] == 1:
        return MaskSpec(T, S, is_causal, m, None)
    return MaskSpec(T, S, is_causal, None, m)


def visible_sum_and_count(v: Tensor, mask: MaskSpec, Hq: int) -> tuple[Tensor, Tensor]:
    """Sum of visible values per query and the number of visible keys, accumulated in float32 (float64 for float64).

    v: (B, Hkv, S, D). Returns (sum, count): sum (B, Hkv|Hq, T|1, D), count broadcastable to it.
    Structured masks give Hkv heads (the caller broadcasts over query groups); dense masks give Hq heads.
    Prefix sums under a causal mask keep this O(S * D), never T x S.
    """
    from .._compat import float_acc  # local import keeps this module free of cycles

    acc = float_acc(v.dtype)
    B, Hkv, S, D = v.shape
    if mask.dense is not None:
        vis = mask.dense_bool(v.device).to(acc)  # (B|1, H|1, T, S): slow exact path only
        vh = v.to(acc)
        if vis.shape[1] != 1 and Hq != Hkv:
            vh = vh.repeat_interleave(Hq // Hkv, dim=1)
        return vis @ vh, vis.sum(-1, keepdim=True)
    vf = v.to(acc)
    km = None if mask.keys is None else mask.keys[:, :, 0, :, None].to(acc)  # (B|1, 1, S, 1)
    if km is not None:
        vf = vf * km
    if not mask.causal or mask.causal_is_trivial:
        total = vf.sum(-2, keepdim=True)
        count = km.sum(-2, keepdim=True) if km is not None else torch.full((1, 1, 1, 1), float(S), dtype=acc,
                                                                          device=v.device)
        return total, count
    if mask.offset >= 0:
        # Query i's last visible key is i + offset: a slice of the prefix sums, no gather needed.
        csum = vf.cumsum(-2)[:, :, mask.offset:]
        count = (km.cumsum(-2)[:, :, mask.offset:] if km is not None
                 else torch.arange(mask.offset + 1, mask.S + 1, device=v.device, dtype=acc)[None, None, :, None])
        return csum, count
    rows = torch.arange(mask.T, device=v.device) + mask.offset  # last visible key of each query
    valid = rows >= 0
    idx = rows.clamp(min=0)
    csum = vf.cumsum(-2).index_select(-2, idx)
    count = km.cumsum(-2).index_select(-2, idx) if km is not None else (idx + 1).to(acc)[None, None, :, None]
    if not bool(valid.all()):
        # T > S: the first queries see no key at all.
        csum = csum * valid[:, None].to(acc)
        count = count * valid[:, None].to(acc)
    return csum, count
