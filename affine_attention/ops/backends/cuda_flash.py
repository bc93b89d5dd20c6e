"""Flash attention on CUDA through aten `_flash_attention_forward/_backward` (FA2; dense and varlen), with its lse.

The kernel aligns causal bottom-right like this library, takes GQA natively and a sliding window as
window_size_left = window - 1. Key padding and packed documents become varlen segments (cumulative sequence
lengths), so no T x S mask is ever built. Never goes through cuDNN (NaN-gradient bugs with masks on H100/H200).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from ..._compat import float_acc
from ..call import Score
from ..masks import MaskSpec, key_spans
from .base import Backend, Call, register

# The kernel's limits (pytorch's vendored FA2): fp16/bf16, head dim a multiple of 8 and at most 256.
DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def _ops():
    """The aten pair (looked up per call, so that tests can substitute a CPU model of the kernel)."""
    return torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward


@functools.cache
def _platform_reason() -> str | None:
    """Why this process cannot run the kernel at all (None if it can). Tests on meta tensors patch this."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no flash attention kernel"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"flash attention needs compute capability >= 8.0 (this GPU has {major}.{minor})"
    return None


class Part(NamedTuple):
    """One varlen kernel call: query segments cu_q over the rows q_index of the flat (B*T) queries, each seeing
    its key segment of cu_k over the rows k_index of the flat (B*S) keys. None index: every row, in order.
    rows: (B*T,) bool, the query rows whose result this call gives (None: every row); fold: decoding's layout, one
    row per (batch row, KV head) holding its group of query heads (see `_fold_part`)."""

    q_index: Tensor | None  # (n_q,) int64
    k_index: Tensor | None  # (n_k,) int64
    cu_q: Tensor  # (segments + 1,) int32
    cu_k: Tensor  # (segments + 1,) int32
    max_q: int
    max_k: int
    causal: bool
    rows: Tensor | None = None
    fold: bool = False

    def to(self, device: torch.device) -> "Part":
        """The part on `device` (a no-op where it is already; the meta tests plan on CPU and run on meta)."""
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return self._replace(q_index=move(self.q_index), k_index=move(self.k_index), cu_q=move(self.cu_q),
                             cu_k=move(self.cu_k), rows=move(self.rows))


def _causal(mask: MaskSpec) -> bool:
    """The kernel's causal flag: off where causal hides nothing (one query after its whole cache)."""
    return mask.causal and not mask.causal_is_trivial


def _window(mask: MaskSpec, causal: bool) -> tuple[int, int]:
    """(window_size_left, window_size_right) for one kernel call; -1 = unbounded. A window always comes with a
    causal mask, whose right edge (0) it keeps even where the causal flag is dropped (one decoding query)."""
    if "window" in mask.kinds:
        return mask.window - 1, 0
    return -1, 0 if causal else -1


def _cumulative(counts: Tensor) -> Tensor:
    """(..., n) segment lengths -> (numel + 1,) int32 cumulative lengths, on the device: no host sync."""
    flat = counts.reshape(-1)
    return torch.cat([flat.new_zeros(1), flat.cumsum(0)]).to(torch.int32)


def _key_parts(mask: MaskSpec, B: int, Hq: int, Hkv: int) -> list[Part]:
    """Key padding as varlen segments over the un-padded flat layout, with no host sync and no copy of the keys.

    Per row, the keys split into [0, first) | [first, end) | [end, S) and the queries (positions p = S - T + i) into
    A (p < first), V (first <= p < end) and C (p >= end). Segments with no queries cover the padded keys (so every
    key row belongs to a segment), segments with no keys give empty rows (out 0). Under causal, V's queries over
    [first, end) align bottom-right exactly as the row does; C's queries (right padding) see every valid key, which
    a causal call cannot express, so a second, non-causal call gives them (it does no work without right padding).
    One decoding query (T = 1) without a window folds each KV head's group of query heads into one segment.
    """
    T, S = mask.T, mask.S
    first, end, _ = key_spans(mask.keys, B)
    if T == 1 and "window" not in mask.kinds:
        return [_fold_part(first, end, S, Hkv, Hq // Hkv)]
    zero = torch.zeros_like(first)
    if not _causal(mask):
        return [Part(None, None, _cumulative(torch.stack([zero, zero + T, zero], 1)),
                     _cumulative(torch.stack([first, end - first, S - end], 1)), T, S, False)]
    n_a = (first - (S - T)).clamp(0, T)
    n_c = T - (end - (S - T)).clamp(0, T)
    n_v = T - n_a - n_c
    parts = [Part(None, None, _cumulative(torch.stack([n_a, zero, n_v, n_c, zero], 1)),
                  _cumulative(torch.stack([zero, first, end - first, zero, S - end], 1)), T, S, True)]
    if mask.runs().right:
        pos = torch.arange(T, device=first.device) + (S - T)
        late = (pos[None, :] >= end[:, None]).reshape(B * T)
        parts.append(Part(None, None, _cumulative(torch.stack([n_a + n_v, zero, n_c, zero], 1)),
                          _cumulative(torch.stack([zero, first, end - first, S - end], 1)), T, S, False, late))
    return parts


def _fold_part(first: Tensor, end: Tensor, S: int, Hkv: int, G: int) -> Part:
    """One decoding query per head: the G query heads of each (batch row, KV head) become G queries of a one-head
    segment over that head's cache row, which (B, Hkv, S, D) storage already lays out contiguously."""
    B = first.shape[0]
    first, end = (x[:, None].expand(B, Hkv) for x in (first, end))
    zero = torch.zeros_like(first)
    return Part(None, None, _cumulative(torch.stack([zero, zero + G, zero], 2)),
                _cumulative(torch.stack([first, end - first, S - end], 2)), G, S, False, fold=True)


def _key_padding_reason(mask: MaskSpec) -> str | None:
    runs = mask.runs()
    if runs is None:
        # Varlen segments need one run of valid keys per row; a graph cannot check that, and a guess would be wrong.
        return ("key padding whose runs cannot be checked under torch.compile (nothing read them eagerly): compile "
                "the decoder layers rather than the whole model (the seam's mask function then reads them once per "
                "forward), or parse the mask outside the graph with parse_mask(..., key_runs=read_key_runs(keys))")
    if not runs.contiguous:
        return "key padding that is not one contiguous run of valid keys per row"
    if "window" in mask.kinds and runs.right:
        return "a sliding window with right key padding (queries past the last valid key need a per-row offset)"
    return None


def _document_parts(mask: MaskSpec, B: int) -> list[Part]:
    """One part: a segment per (row, document that has queries). Queries of a document are the positions
    [max(start, S - T), end) and see keys [start, end): bottom-right alignment inside the segment is then exactly
    the causal rule (and window) of the whole row. Documents wholly in the cache are left out of the keys."""
    T, S, off = mask.T, mask.S, mask.offset
    docs = mask.documents.expand(B, S)
    pos = torch.arange(S, device=docs.device)
    new = torch.ones(B, S, dtype=torch.bool, device=docs.device)
    new[:, 1:] = docs[:, 1:] != docs[:, :-1]
    q_start = new[:, off:].clone()
    q_start[:, 0] = True
    first_key = torch.where(new, pos, 0).cummax(1).values[:, off]  # (B,): start of the first query's document
    used = pos[None] >= first_key[:, None]
    k_start = (new & used).flatten()
    packed = used.flatten().cumsum(0) - 1
    cu_q = torch.cat([q_start.flatten().nonzero()[:, 0], q_start.new_full((1,), B * T, dtype=torch.int64)])
    cu_k = torch.cat([packed[k_start], packed[-1:] + 1])
    if cu_q.numel() != cu_k.numel():
        raise RuntimeError(f"cuda_flash: {cu_q.numel() - 1} query and {cu_k.numel() - 1} key segments")
    max_q, max_k, skipped = torch.stack([cu_q.diff().max(), cu_k.diff().max(), first_key.max()]).tolist()
    k_index = used.flatten().nonzero()[:, 0] if skipped > 0 else None
    return [Part(None, k_index, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, _causal(mask))]


def _documents_reason(mask: MaskSpec) -> str | None:
    if mask.keys is not None:
        return "documents together with key padding (give padding its own document id instead)"
    if mask.varlen is None and not mask.host_facts_known():
        return ("packed documents under torch.compile without their cumulative lengths (their segments need a host "
                "sync): pass transformers' cu_seq_lens_q/k and max_length_q/k (DataCollatorWithFlattening("
                "return_flash_attn_kwargs=True)), or run eager")
    return None


def reason(mask: MaskSpec, B: int) -> str | None:
    """Why this kernel cannot serve `mask` (None: it can). Decided once per mask object."""
    if mask.documents is not None:
        return _documents_reason(mask)
    if mask.keys is not None:
        return _key_padding_reason(mask)
    return None


def kernel_parts(mask: MaskSpec, B: int, Hq: int, Hkv: int) -> list[Part] | None:
    """The varlen calls for `mask` (None: one dense call), derived once per mask object (so once per forward)."""
    if mask.documents is None and mask.keys is None:
        return None
    why = reason(mask, B)
    if why is not None:
        raise ValueError(f"cuda_flash cannot serve this mask: {why}")
    if mask.documents is None:
        return mask.derived(("cuda_flash.parts", B, Hq, Hkv), lambda: _key_parts(mask, B, Hq, Hkv))
    v = mask.varlen
    if v is not None:  # given by the caller (one packed row, T == S): no host work at all
        return [Part(None, None, v.cu_q, v.cu_k, v.max_q, v.max_k, _causal(mask))]
    return mask.derived(("cuda_flash.documents", B), lambda: _document_parts(mask, B))


def _bthd(x: Tensor) -> Tensor:
    """(B, H, T, D) -> the kernel's (B, T, H, D), a view when the last dim is contiguous."""
    x = x.transpose(1, 2)
    return x if x.stride(-1) == 1 else x.contiguous()


def _flat(x: Tensor, index: Tensor | None) -> Tensor:
    """(B, H, T, D) -> varlen rows (n, H, D): all B*T rows, or those in index."""
    x = x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])
    return x if index is None else x.index_select(0, index)


def _rows(x: Tensor, part: Part, index: Tensor | None) -> Tensor:
    """x (B, H, L, D) in the part's layout: flat (n, H, D) rows, or folded (B*H*L, 1, D) one-head rows."""
    return x.reshape(-1, 1, x.shape[3]) if part.fold else _flat(x, index)


def _may_have_empty_rows(mask: MaskSpec) -> bool:
    """Whether some query may see no key: causal with T > S, or key padding (documents always see themselves)."""
    return mask.keys is not None or (_causal(mask) and mask.T > mask.S)


def _zero_rows(x: Tensor, empty: Tensor, mask: MaskSpec) -> Tensor:
    """x with the rows of queries that see no key set to 0 (the kernel's own zeros are not relied on).
    x: (..., D); empty: bool of x's shape without D."""
    return x.masked_fill(empty[..., None], 0) if _may_have_empty_rows(mask) else x


def _unused(device) -> tuple[Tensor, Tensor]:
    """rng_state / unused placeholders for the backward: dropout is 0, so the kernel never reads them."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


@register
class CudaFlashBackend(Backend):
    name = "cuda_flash"
    priority = 30  # the lse path on CUDA
    layout = "last_dim_contiguous"

    def supports(self, call: Call) -> str | None:
        if call.device_type != "cuda":
            return f"runs on CUDA only (got {call.device_type})"
        why = _platform_reason()
        if why is not None:
            return why
        if call.dtype not in DTYPES:
            return f"dtype {call.dtype} (float16 or bfloat16 only)"
        if call.D % 8 != 0 or call.D > MAX_HEAD_DIM:
            return f"head dim {call.D} (a multiple of 8, at most {MAX_HEAD_DIM})"
        if min(call.B, call.T, call.S) == 0:
            return f"an empty dimension (B, T, S) = {(call.B, call.T, call.S)}"
        if "dense" in call.mask.kinds:
            return "a dense boolean mask"
        return reason(call.mask, call.B)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, score: Score) -> tuple[Tensor, Tensor]:
        scale = score.scale
        """q: (B, Hq, T, D); k, v: (B, Hkv, S, D) -> out (B, Hq, T, D) q.dtype, lse (B, Hq, T) float32."""
        fwd, _ = _ops()
        B, Hq, T, D = q.shape
        S = k.shape[2]
        causal = _causal(mask)
        parts = kernel_parts(mask, B, Hq, k.shape[1])
        if parts is None:
            left, right = _window(mask, causal)
            out, lse = fwd(_bthd(q), _bthd(k), _bthd(v), None, None, T, S, 0.0, causal, False, scale=scale,
                           window_size_left=left, window_size_right=right)[:2]
            lse = lse.reshape(B, Hq, T)
            empty = lse.isinf()  # the kernel marks a row that sees no key with lse = +inf; ours is -inf
            return _zero_rows(out.transpose(1, 2), empty, mask), lse.masked_fill(empty, float("-inf"))
        out = lse = None
        for part in parts:
            part = part.to(q.device)
            left, right = _window(mask, part.causal)
            o, l_ = fwd(_rows(q, part, part.q_index), _rows(k, part, part.k_index), _rows(v, part, part.k_index),
                        part.cu_q, part.cu_k, part.max_q, part.max_k, 0.0, part.causal, False, scale=scale,
                        window_size_left=left, window_size_right=right)[:2]
            if part.fold:  # (B*Hq, 1, D) and (1, B*Hq): one query (T = 1) per (batch row, head)
                o, l_ = o.view(B * T, Hq, D), l_.reshape(B, Hq).t()
            l_ = l_.reshape(Hq, -1)
            if part.q_index is not None:  # documents wholly in the cache are left out: their rows stay empty
                # Out of place: torch 2.11's dynamo gives a zero gradient to an autograd.Function whose output an
                # in-place op made.
                o = q.new_zeros(B * T, Hq, D).index_copy(0, part.q_index, o)
                l_ = torch.full((Hq, B * T), float("inf"), dtype=l_.dtype, device=q.device).index_copy(
                    1, part.q_index, l_)
            if out is None:
                out, lse = o, l_
            else:  # the second call gives the rows it serves
                out = torch.where(part.rows[:, None, None], o, out)
                lse = torch.where(part.rows[None], l_, lse)
        empty = lse.isinf()
        out = _zero_rows(out, empty.t(), mask)
        lse = lse.masked_fill(empty, float("-inf")).to(float_acc(q.dtype))
        out = out.view(B, T, Hq, D).transpose(1, 2)
        return out, lse.view(Hq, B, T).transpose(0, 1)

    def backward(self, dout, q, k, v, out, lse, mask, score):
        scale = score.scale
        """dout, out: (B, Hq, T, D); lse: (B, Hq, T) -> dq (B, Hq, T, D), dk, dv (B, Hkv, S, D)."""
        _, bwd = _ops()
        B, Hq, T, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        causal = _causal(mask)
        rng, unused = _unused(q.device)
        # Back to the kernel's marker for empty rows: with +inf their weights exp(x - lse) are 0, not inf.
        empty = lse == float("-inf")
        lse = lse.to(float_acc(q.dtype)).masked_fill(empty, float("inf"))
        parts = kernel_parts(mask, B, Hq, Hkv)
        if parts is None:
            left, right = _window(mask, causal)
            dq, dk, dv = bwd(_bthd(dout), _bthd(q), _bthd(k), _bthd(v), _bthd(out), lse.contiguous(), None, None,
                             T, S, 0.0, causal, rng, unused, scale=scale, window_size_left=left,
                             window_size_right=right)
            return _zero_rows(dq.transpose(1, 2), empty, mask), dk.transpose(1, 2), dv.transpose(1, 2)
        lse_rows = lse.transpose(0, 1).reshape(Hq, B * T)  # varlen layout (Hq, total)
        dq = dkv = None
        for part in parts:
            part = part.to(q.device)
            left, right = _window(mask, part.causal)
            if part.fold:
                rows = lse.reshape(1, B * Hq)
            else:
                rows = lse_rows if part.q_index is None else lse_rows.index_select(1, part.q_index)
            g_q, g_k, g_v = bwd(_rows(dout, part, part.q_index), _rows(q, part, part.q_index),
                                _rows(k, part, part.k_index), _rows(v, part, part.k_index),
                                _rows(out, part, part.q_index), rows.contiguous(), part.cu_q, part.cu_k, part.max_q,
                                part.max_k, 0.0, part.causal, rng, unused, scale=scale, window_size_left=left,
                                window_size_right=right)
            if part.fold:  # the only part: back to (B, H, L, D) directly
                dq = _zero_rows(g_q.view(B, Hq, T, D), empty, mask)
                return dq, g_k.view(B, Hkv, S, D), g_v.view(B, Hkv, S, D)
            if part.q_index is not None:
                g_q = q.new_zeros(B * T, Hq, D).index_copy_(0, part.q_index, g_q)
            dq = g_q if dq is None else torch.where(part.rows[:, None, None], g_q, dq)
            if part.k_index is not None:
                g_k, g_v = (torch.zeros(B * S, Hkv, D, dtype=g.dtype, device=g.device).index_add_(0, part.k_index, g)
                            for g in (g_k, g_v))
            if dkv is None:
                dkv = (g_k, g_v) if len(parts) == 1 else tuple(g.to(float_acc(k.dtype)) for g in (g_k, g_v))
            else:  # keys seen by both calls: summed in float32, rounded once
                dkv = tuple(a + b.to(a.dtype) for a, b in zip(dkv, (g_k, g_v)))
        dq = _zero_rows(dq, empty.transpose(1, 2).reshape(B * T, Hq), mask)
        back = (lambda x, n: x.view(B, n, x.shape[1], D).transpose(1, 2))  # noqa: E731
        return back(dq, T), back(dkv[0].to(k.dtype), S), back(dkv[1].to(v.dtype), S)
