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
    window: each query sees at most its last `window` keys, itself included (transformers' sliding_window),
      bottom-right aligned: query i sees key j iff i + S - T - window < j; always combined with causal.
    documents: (B|1, S) int64 document id of every key position, non-decreasing along S (packed rows); query i
      has the id of key position i + S - T and sees only keys of its own document. None if absent.
    """

    T: int
    S: int
    causal: bool
    keys: Tensor | None
    dense: Tensor | None
    window: int | None = None
    documents: Tensor | None = None

    @property
    def kinds(self) -> frozenset[str]:
        """The mask kinds in force: a subset of {"causal", "keys", "window", "documents", "dense"}; a backend
        declares which it handles. A causal rule that hides nothing (one query after its cache) is not listed."""
        kinds = set()
        if self.causal and not self.causal_is_trivial:
            kinds.add("causal")
        if self.keys is not None:
            kinds.add("keys")
        if self.window is not None and self.window < self.S:
            kinds.add("window")
        if self.documents is not None:
            kinds.add("documents")
        if self.dense is not None:
            kinds.add("dense")
        return frozenset(kinds)

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
        return self.chunk_bool(0, self.T, device)

    def chunk_bool(self, start: int, stop: int, device: torch.device) -> Tensor:
        """Visibility of queries start..stop-1 as one bool mask broadcastable to (B, Hq, stop - start, S)."""
        i = torch.arange(start, stop, device=device)[:, None] + self.offset  # absolute position of each query
        j = torch.arange(self.S, device=device)[None, :]
        m = torch.ones(stop - start, self.S, dtype=torch.bool, device=device)
        if self.causal:
            m = m & (j <= i)
        if self.window is not None:
            m = m & (j > i - self.window)
        m = m[None, None]
        if self.documents is not None:
            qdoc = self.documents[:, self.offset + start:self.offset + stop]  # (B|1, C)
            m = m & (qdoc[:, None, :, None] == self.documents[:, None, None, :])
        if self.keys is not None:
            m = m & self.keys
        if self.dense is not None:
            m = m & self.dense[:, :, start:stop] if self.dense.shape[2] != 1 else m & self.dense
        return m


def _check_window(window, is_causal: bool) -> int | None:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int (each query sees at most its last `window` keys, itself "
                         f"included) or None, got {window!r}")
    if not is_causal:
        raise ValueError("window needs is_causal=True: the sliding window counts back from each query's own "
                         "position (transformers' sliding_window); for other patterns pass a boolean attn_mask")
    return window


def _check_documents(document_ids, B: int, T: int, S: int, device: torch.device) -> Tensor | None:
    if document_ids is None:
        return None
    if not isinstance(document_ids, Tensor):
        raise ValueError(f"document_ids must be an integer tensor of shape (B, S) or None, got "
                         f"{type(document_ids).__name__}")
    if document_ids.is_floating_point() or document_ids.is_complex() or document_ids.dtype == torch.bool:
        raise ValueError(f"document_ids must be an integer tensor (one document id per key position), got dtype "
                         f"{document_ids.dtype}")
    if document_ids.dim() != 2 or document_ids.shape[0] not in (1, B) or document_ids.shape[1] != S:
        raise ValueError(f"document_ids must have shape (B, S) = {(B, S)} (queries are the last T = {T} "
                         f"positions), got {tuple(document_ids.shape)}")
    if document_ids.device != device:
        raise ValueError(f"document_ids is on {document_ids.device} but q is on {device}")
    if S > 1 and not torch.compiler.is_compiling() and bool((document_ids[:, 1:] < document_ids[:, :-1]).any()):
        raise ValueError("document_ids must be non-decreasing along each row (packed documents one after another); "
                         "for other patterns pass a boolean attn_mask")
    return document_ids.long()


def parse_mask(attn_mask: Tensor | None, is_causal: bool, B: int, Hq: int, T: int, S: int,
               device: torch.device, *, window: int | None = None, document_ids: Tensor | None = None) -> MaskSpec:
    """Validate attn_mask (bool, broadcastable to (B, Hq, T, S), True = may attend), window and document_ids
    ((B, S) int), and classify them."""
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
    window = _check_window(window, is_causal)
    documents = _check_documents(document_ids, B, T, S, device)
    if attn_mask is None:
        return MaskSpec(T, S, is_causal, None, None, window, documents)
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
        return MaskSpec(T, S, is_causal, m, None, window, documents)
    return MaskSpec(T, S, is_causal, None, m, window, documents)


def visible_sum_and_count(v: Tensor, mask: MaskSpec, Hq: int) -> tuple[Tensor, Tensor]:
    """Sum of visible values per query and the number of visible keys, accumulated in float32 (float64 for float64).

    v: (B, Hkv, S, D). Returns (sum, count): sum (B, Hkv|Hq, T|1, D), count broadcastable to it.
    Structured masks give Hkv heads (the caller broadcasts over query groups); dense masks give Hq heads.
    Prefix sums under a causal mask keep this O(S * D), never T x S.
    """
    from .._compat import float_acc  # local import keeps this module free of cycles

    acc = float_acc(v.dtype)
    B, Hkv, S, D = v.shape
    if mask.dense is not None or mask.window is not None or mask.documents is not None:
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
