"""Mask normalisation: turns (attn_mask, is_causal) into a structured form the fast paths use without T x S tensors."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._memo import MISS, TensorMemo


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

    # Read several times per op call (isolation, backend choice, the mean of V): computed once, at construction.
    kinds: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        """kinds: the mask kinds in force, a subset of {"causal", "keys", "window", "documents", "dense"}; a backend
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
        object.__setattr__(self, "kinds", frozenset(kinds))

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

    def chunk_bool(self, start: int, stop: int, device: torch.device, key_start: int = 0,
                   key_stop: int | None = None) -> Tensor:
        """Visibility of queries start..stop-1 over keys key_start..key_stop-1 (default: all S) as one bool mask
        broadcastable to (B, Hq, stop - start, key_stop - key_start)."""
        key_stop = self.S if key_stop is None else key_stop
        i = torch.arange(start, stop, device=device)[:, None] + self.offset  # absolute position of each query
        j = torch.arange(key_start, key_stop, device=device)[None, :]
        m = torch.ones(stop - start, key_stop - key_start, dtype=torch.bool, device=device)
        if self.causal:
            m = m & (j <= i)
        if self.window is not None:
            m = m & (j > i - self.window)
        m = m[None, None]
        if self.documents is not None:
            qdoc = self.documents[:, self.offset + start:self.offset + stop]  # (B|1, C)
            m = m & (qdoc[:, None, :, None] == self.documents[:, None, None, key_start:key_stop])
        if self.keys is not None:
            m = m & self.keys[..., key_start:key_stop]
        if self.dense is not None:
            d = self.dense if self.dense.shape[2] == 1 else self.dense[:, :, start:stop]
            m = m & (d if d.shape[3] == 1 else d[..., key_start:key_stop])
        return m

    def key_ranges(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(lo, hi): (B|1, T) int64; causal, window and documents let query i see at most keys lo_i <= j < hi_i
        (key padding and dense masks may hide more). Both are non-decreasing in i; an empty range has lo = hi."""
        p = torch.arange(self.T, device=device) + self.offset  # absolute position of each query
        hi = p + 1 if self.causal else torch.full_like(p, self.S)
        lo = p - self.window + 1 if self.window is not None else torch.zeros_like(p)
        lo, hi = lo[None], hi[None]
        if self.documents is not None:
            docs = self.documents.contiguous()
            qdoc = docs[:, self.offset:].contiguous()  # (B|1, T): documents need T <= S (parse_mask)
            lo = torch.maximum(lo, torch.searchsorted(docs, qdoc, side="left"))
            hi = torch.minimum(hi, torch.searchsorted(docs, qdoc, side="right"))
        lo = lo.clamp(0, self.S)
        return lo, torch.maximum(hi.clamp(0, self.S), lo)

    def static_key_range(self, start: int, stop: int) -> tuple[int, int]:
        """Keys [lo, hi) that queries start..stop-1 can see under causal and window, from the shapes alone (no
        look at documents or padding, so no host sync): the band a block of queries needs."""
        hi = min(self.S, stop + self.offset) if self.causal else self.S
        lo = max(0, start + self.offset - self.window + 1) if self.window is not None else 0
        return min(lo, max(hi, 0)), max(hi, 0)


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
    if T > S:
        raise ValueError(f"document_ids needs T <= S (queries are the last T of the S key positions), got T = {T} "
                         f"and S = {S}")
    if document_ids.device != device:
        raise ValueError(f"document_ids is on {document_ids.device} but q is on {device}")
    if torch.compiler.is_compiling():
        return document_ids.long()
    checked = _DOCUMENTS.get(document_ids)
    if checked is not MISS:
        return checked
    if S > 1 and bool((document_ids[:, 1:] < document_ids[:, :-1]).any()):
        raise ValueError("document_ids must be non-decreasing along each row (packed documents one after another); "
                         "for other patterns pass a boolean attn_mask")
    # The same int64 tensor for every layer, so that per-mask plans downstream (cuda_flash) hit their memo too.
    return _DOCUMENTS.put(document_ids, document_ids.long())


# Every layer of a packed forward passes the same document ids: their check (a host sync) runs once per forward.
_DOCUMENTS = TensorMemo(4)


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
        # A key mask always spans S (a (..., 1) mask broadcast over keys would count 1 visible key, not S).
        return MaskSpec(T, S, is_causal, m.expand(*m.shape[:3], S), None, window, documents)
    return MaskSpec(T, S, is_causal, None, m, window, documents)


def visible_sum_and_count(v: Tensor, mask: MaskSpec, Hq: int) -> tuple[Tensor, Tensor]:
    """Sum of visible values per query and the number of visible keys, accumulated in float32 (float64 for float64).

    v: (B, Hkv, S, D). Returns (sum, count): sum (B, Hkv|Hq, T|1, D), count broadcastable to it.
    Structured masks give Hkv heads (the caller broadcasts over query groups); dense masks give Hq heads.
    Prefix sums keep every structured mask (causal, padding, window, documents) O(S * D), never T x S.
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
    if mask.kinds & {"window", "documents"}:
        return _banded_sum_and_count(vf, km, mask)
    if km is not None:
        vf = vf * km
    if not mask.causal or mask.causal_is_trivial:
        total = vf.sum(-2, keepdim=True)
        count = km.sum(-2, keepdim=True) if km is not None else torch.full((1, 1, 1, 1), float(S), dtype=acc,
                                                                          device=v.device)
        return total, count
    if mask.offset >= 0:
        # Query i's last visible key is i + offset: a slice of the prefix sums, no gather needed. In place on a
        # contiguous copy (the one a dtype conversion or the key mask made, or a fresh one): on CPU a copy plus an
        # in-place scan is a third faster than the out-of-place scan, and needs no second buffer.
        vf = vf.clone(memory_format=torch.contiguous_format) if vf is v or not vf.is_contiguous() else vf
        csum = vf.cumsum_(-2)[:, :, mask.offset:]
        count = (km.cumsum(-2)[:, :, mask.offset:] if km is not None
                 else torch.arange(mask.offset + 1, mask.S + 1, device=v.device, dtype=acc)[None, None, :, None])
        return csum, count
    # T > S: the first -offset queries see no key at all; the rest are a slice of the prefix sums. Shapes alone
    # decide this, so no host sync.
    empty = -mask.offset
    csum = torch.cat([vf.new_zeros(B, Hkv, empty, D), vf.cumsum(-2)], dim=-2)
    count = (torch.cat([km.new_zeros(km.shape[0], 1, empty, 1), km.cumsum(-2)], dim=-2) if km is not None
             else torch.cat([torch.zeros(empty, device=v.device, dtype=acc),
                             torch.arange(1, S + 1, device=v.device, dtype=acc)])[None, None, :, None])
    return csum, count


def _per_row(fn, x: Tensor, idx: Tensor) -> Tensor:
    """fn(x_b (H, L, E), idx_b (n,)) for every batch row of x: (B|1, H, L, E) and idx: (B|1, n), broadcast; 1-D
    index ops along one dim are several times faster on CPU than a gather/scatter with an expanded index."""
    if idx.shape[0] == 1:
        return fn(x, idx[0], 2)
    return torch.stack([fn(x[min(b, x.shape[0] - 1)], idx[b], 1) for b in range(idx.shape[0])])


def _take(x: Tensor, idx: Tensor) -> Tensor:
    """x: (B|1, H, L, E), idx: (B|1, T) positions along L -> (B', H, T, E), B' the broadcast batch."""
    return _per_row(lambda xb, ib, dim: xb.index_select(dim, ib), x, idx)


def _segment_sum(x: Tensor, seg: Tensor) -> Tensor:
    """x: (B|1, H, S, E), seg: (B|1, S) segment of each position -> per segment sums (B', H, S, E) (at most S)."""
    return _per_row(lambda xb, ib, dim: torch.zeros_like(xb).index_add(dim, ib, xb), x, seg)


def _banded_sum_and_count(vf: Tensor, km: Tensor | None, mask: MaskSpec) -> tuple[Tensor, Tensor]:
    """Sliding window and/or documents as differences of centred float32 prefix sums.

    vf: (B, Hkv, S, D) float; km: (B|1, 1, S, 1) key padding as 0/1 or None. Positions are cut into segments
    (each document, further cut every `window` keys); every visible value is centred on its segment's mean before
    the prefix sum, so the prefix returns to ~0 at every segment end and its rounding error stays that of one
    segment, independent of S. A query's keys [lo, hi) lie in one document and span at most `window` keys, so
    they touch at most two segments: their means are added back times the visible count in each.
    Returns sum (B, Hkv, T, D) and count (B|1, 1, T, 1).
    """
    B, Hkv, S, D = vf.shape
    dev = vf.device
    lo, hi = mask.key_ranges(dev)  # (Bd, T) each
    j = torch.arange(S, device=dev)
    start = j == 0
    if "window" in mask.kinds:
        cut = j % mask.window == 0
        start = start | cut
        # First window cut after each position, by a reverse running minimum: a floor division feeding the
        # gathers below trips inductor's value-range analysis under torch.compile.
        after = torch.where(cut, j, S).flip(0).cummin(0).values.flip(0)
        after = torch.cat([after, after.new_full((1,), S)])  # (S + 1,)
    start = start[None]
    if mask.documents is not None:
        d = mask.documents
        start = start | torch.cat([torch.ones_like(d[:, :1], dtype=torch.bool), d[:, 1:] != d[:, :-1]], dim=1)
    seg = start.long().cumsum(1) - 1  # (Bd, S): segment of every key position
    w = km if km is not None else vf.new_ones(1, 1, S, 1)
    seg_count = _segment_sum(w, seg)
    seg_mean = _segment_sum(vf * w if km is not None else vf, seg) / seg_count.clamp(min=1)
    centre = _take(seg_mean, seg)  # (B, Hkv, S, D): mean of the visible values of each position's segment
    u = (vf - centre) * w if km is not None else vf - centre
    zero = vf.new_zeros(B, Hkv, 1, D)
    cu = torch.cat([zero, u.cumsum(2)], dim=2)  # (B, Hkv, S + 1, D): exclusive prefix of centred values
    # The second segment starts at the first window cut after lo (documents never cut inside [lo, hi)).
    mid = torch.minimum(hi, after[(lo + 1).clamp(max=S)]) if "window" in mask.kinds else hi
    if km is not None:
        ck = torch.cat([w.new_zeros(w.shape[0], 1, 1, 1), w.cumsum(2)], dim=2)  # (B|1, 1, S + 1, 1)
        n1, n2 = _take(ck, mid) - _take(ck, lo), _take(ck, hi) - _take(ck, mid)
    else:
        n1, n2 = (mid - lo).to(vf.dtype)[:, None, :, None], (hi - mid).to(vf.dtype)[:, None, :, None]
    first = _take(centre, lo.clamp(max=S - 1))
    last = _take(centre, (hi - 1).clamp(min=0))
    total = _take(cu, hi) - _take(cu, lo) + first * n1 + last * n2
    return total, n1 + n2
