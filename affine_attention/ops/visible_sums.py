"""Sum and number of the values each query may see, under every structured mask without a T x S tensor: prefix sums
for causal and padding; segmented scans for sliding windows and packed documents, where no sum ever adds a key its
query cannot see (no prefix differences) and the number of torch ops does not grow with the batch."""
from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from .._compat import float_acc
from .masks import MaskSpec


def banded_sum_and_count(vf: Tensor, km: Tensor | None, mask: MaskSpec) -> tuple[Tensor, Tensor]:
    """Sum and number of the visible values of every query under a window and/or documents.

    vf: (B, Hkv, S, D) float (the accumulation dtype); km: (B|1, 1, S, 1) key padding as 0/1 in vf's dtype, or None;
    mask: the MaskSpec (its window and/or documents in force). Returns total (B, Hkv, T, D), count (B|1, 1, T, 1).

    Key positions are cut into segments: each document, further cut at every multiple of `window`. Query i sees
    keys [lo, hi) (key_ranges): under causal hi - 1 = p, its own position, and lo = max(p - window + 1, document
    start); without causal (documents only) the whole document. Let s be the start of the segment of hi - 1. If s is
    a document start, lo = s. Otherwise s is a window cut and the previous segment, [max(document start,
    s - window), s), holds lo. So [lo, hi) is a prefix of one segment, or the suffix of one segment plus a prefix of
    the next: one or two values of scans that restart at every segment, each a sum of visible keys alone.
    """
    B, Hkv, S, D = vf.shape
    dev = vf.device
    lo, hi = mask.key_ranges(dev)  # (Bd, T) each, Bd = B or 1
    j = torch.arange(S, device=dev)
    zero = vf.new_zeros(())  # one zero for every selection below (a Python 0.0 costs a dispatch per use)
    # Padded keys become exact zeros by selection: a product with 0 would turn an inf into a nan.
    x = vf if km is None else torch.where(km > 0, vf, zero)
    # Without a window every range is a prefix of its document: no suffix scan needed.
    two_sided = "window" in mask.kinds
    if mask.documents is None:
        start = (j == 0)[None]  # (1, S)
    else:
        d = mask.documents
        start = torch.cat([torch.ones_like(d[:, :1], dtype=torch.bool), d[:, 1:] != d[:, :-1]], dim=1)  # (Bd, S)
    if two_sided:
        start = start | (_offsets_in_blocks(S, mask.window, dev) == 0)
    # One segmented scan for every case: a window alone could reshape into blocks and cumsum each, but a reshape
    # feeding the gathers below trips inductor ("vr must not be None for symbol q0", torch 2.13).
    y, into = _segmented_scans(x, start, mask.window if two_sided else S, two_sided)
    last = (hi - 1).clamp(min=0)
    # y[0] at `last`: the prefix of last's segment up to last; y[1], the scan of the reversed sequence, at S - 1 - lo:
    # the suffix of lo's segment from lo. One gather for both.
    idx = torch.stack([last, (S - 1 - lo).clamp(min=0)] if two_sided else [last])  # (1|2, Bd, T)
    g = y.gather(3, idx[:, :, None, :, None].expand(len(idx), B, Hkv, idx.shape[-1], D))  # (1|2, B, Hkv, T, D)
    total = g[0]
    if two_sided:  # two segments exactly when the range reaches back past the start of last's segment
        two = (hi - lo) > into.expand(lo.shape[0], S).gather(1, last) + 1  # (Bd, T)
        total = total + torch.where(two[:, None, :, None], g[1], zero)
    if mask.offset < 0:  # T > S: the first queries see no key
        total = torch.where((hi > lo)[:, None, :, None], total, zero)
    if km is None:
        count = (hi - lo).to(vf.dtype)[:, None, :, None]
    else:  # an integer prefix sum: a difference of counts is exact and carries no value
        ck = F.pad((km[:, 0, :, 0] > 0).long().cumsum(1), (1, 0))  # (B|1, S + 1): kept keys before each position
        n = max(ck.shape[0], lo.shape[0])
        ck = ck.expand(n, S + 1)
        count = (ck.gather(1, hi.expand(n, -1)) - ck.gather(1, lo.expand(n, -1))).to(vf.dtype)[:, None, :, None]
    return total, count


def _offsets_in_blocks(S: int, window: int, device) -> Tensor:
    """(S,) int64: j mod window for every key position j, built by repeating an arange: an integer modulo (or floor
    division) of an index tensor that feeds gathers trips inductor's value-range analysis ("vr must not be None")."""
    return torch.arange(window, device=device).repeat(-(-S // window))[:S]


def _segmented_scans(x: Tensor, start: Tensor, longest: int, two_sided: bool) -> tuple[Tensor, Tensor]:
    """x: (B, H, S, D); start: (Bd, S) bool, True where a segment begins (always at 0); longest: a bound on segment
    lengths -> (y (1|2, B, H, S, D), into (Bd, S)): y[0] the inclusive prefix sums within each segment, y[1] (if
    two_sided) the same over the reversed sequence; into: the offset of every key inside its segment.

    Hillis-Steele doubling, ceil(log2(longest)) steps (both directions at once): step d adds the partial sum d
    positions back where that position lies in the same segment, chosen by masked_fill (never a product with 0, so
    nothing from another segment, not even an inf, reaches a sum).
    """
    S = x.shape[2]
    j = torch.arange(S, device=x.device)
    starts = [start]
    if two_sided:  # a segment ends where the next begins: the reversed sequence's segment starts
        starts.append(torch.cat([start[:, 1:], torch.ones_like(start[:, :1])], dim=1).flip(1))
    starts = torch.stack(starts)  # (1|2, Bd, S)
    into = j - torch.where(starts, j, 0).cummax(2).values  # (1|2, Bd, S): distance back to the segment's start
    y = torch.stack([x, x.flip(2)] if two_sided else [x])  # (1|2, B, H, S, D), a copy: the steps write into it
    near = into[:, :, None, :, None]
    d = 1
    while d < min(longest, S):
        # A roll wraps the last d positions round to the front, where into < d: never chosen. In place on tensors
        # autograd keeps nothing of (roll and masked_fill save no values): a third of the allocations.
        y = y.add_(y.roll(d, 3).masked_fill_(near < d, 0.0))
        d *= 2
    return y, into[0]


def visible_sum_and_count(v: Tensor, mask: MaskSpec, Hq: int) -> tuple[Tensor, Tensor]:
    """Sum of visible values per query and the number of visible keys, accumulated in float32 (float64 for float64).

    v: (B, Hkv, S, D). Returns (sum, count): sum (B, Hkv|Hq, T|1, D), count broadcastable to it.
    Structured masks give Hkv heads (the caller broadcasts over query groups); dense masks give Hq heads.
    Prefix sums keep every structured mask (causal, padding, window, documents) O(S * D), never T x S.
    """
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
        return banded_sum_and_count(vf, km, mask)
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
