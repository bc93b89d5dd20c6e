"""Flash attention on CUDA through aten `_flash_attention_forward/_backward` (FA2; dense and varlen), with its lse.

The kernel aligns causal bottom-right like this library, takes GQA natively and a sliding window as
window_size_left = window - 1. Key padding and packed documents become varlen segments (cumulative sequence
lengths), so no T x S mask is ever built. Never goes through cuDNN (NaN-gradient bugs with masks on H100/H200).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ..._compat import float_acc
from .._memo import MISS, TensorMemo
from ..masks import MaskSpec
from .base import Backend, Call

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


@dataclass(frozen=True)
class Part:
    """One varlen kernel call: query segments cu_q over the rows q_index of the flat (B*T) queries, each seeing
    its key segment of cu_k over the rows k_index of the flat (B*S) keys. None index: every row, in order."""

    q_index: Tensor | None  # (n_q,) int64
    k_index: Tensor | None  # (n_k,) int64
    cu_q: Tensor  # (segments + 1,) int32
    cu_k: Tensor  # (segments + 1,) int32
    max_q: int
    max_k: int
    causal: bool

    def to(self, device: torch.device) -> "Part":
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return Part(move(self.q_index), move(self.k_index), move(self.cu_q), move(self.cu_k), self.max_q,
                    self.max_k, self.causal)


def _causal(mask: MaskSpec) -> bool:
    """The kernel's causal flag: off where causal hides nothing (one query after its whole cache)."""
    return mask.causal and not mask.causal_is_trivial


def _window(mask: MaskSpec, causal: bool) -> tuple[int, int]:
    """(window_size_left, window_size_right) for one kernel call; -1 = unbounded. A window always comes with a
    causal mask, whose right edge (0) it keeps even where the causal flag is dropped (one decoding query)."""
    if "window" in mask.kinds:
        return mask.window - 1, 0
    return -1, 0 if causal else -1


def _ranges(starts: list[int], lengths: list[int], device) -> tuple[Tensor, Tensor]:
    """Concatenated index ranges [starts[i], starts[i] + lengths[i]) and their cumulative lengths (int32)."""
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    total = int(cu[-1])
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths), output_size=total)
    index = torch.arange(total) - cu[:-1][seg] + torch.tensor(starts, dtype=torch.int64)[seg]
    return index.to(device), cu.to(torch.int32).to(device)


def _part(rows: list[tuple[int, int, int, int]], causal: bool, device) -> Part | None:
    """A Part from (q_start, q_len, k_start, k_len) per segment, in flat query / key coordinates."""
    rows = [r for r in rows if r[1] > 0]
    if not rows:
        return None
    q_index, cu_q = _ranges([r[0] for r in rows], [r[1] for r in rows], device)
    k_index, cu_k = _ranges([r[2] for r in rows], [r[3] for r in rows], device)
    return Part(q_index, k_index, cu_q, cu_k, max(r[1] for r in rows), max(r[3] for r in rows), causal)


def _key_padding_parts(mask: MaskSpec, B: int) -> tuple[list[Part], str | None]:
    """Parts for a key-padding mask whose valid keys are one contiguous span [a, e) per row.

    Under causal, query position p = i + S - T sees [a, min(p, e - 1)]: queries with p < e form a causal part on
    keys [a, e) (its bottom-right alignment is then exactly p's), the later ones a non-causal part on the same
    keys. Rows without a valid key are left out (their queries stay empty: out 0, lse -inf).
    """
    T, S, off = mask.T, mask.S, mask.offset
    keys = mask.keys.reshape(mask.keys.shape[0], S).expand(B, S)
    n = keys.sum(1)
    first = keys.int().argmax(1)
    last = S - 1 - keys.flip(1).int().argmax(1)
    stats = torch.stack([n, first, last], 1).tolist()
    causal_rows, open_rows = [], []
    for b, (count, a, last_b) in enumerate(stats):
        if count == 0:
            continue
        if last_b - a + 1 != count:
            return [], f"key padding that is not one contiguous run of valid keys per row (row {b})"
        e = last_b + 1
        if e < S and "window" in mask.kinds:
            # The window counts back from the query's position, the kernel's from the segment's last key.
            return [], f"a sliding window with right key padding (row {b}); left padding is exact"
        split = min(T, max(0, e - off)) if _causal(mask) else 0
        causal_rows.append((b * T, split, b * S + a, e - a))
        open_rows.append((b * T + split, T - split, b * S + a, e - a))
    return [p for p in (_part(causal_rows, True, keys.device), _part(open_rows, False, keys.device)) if p], None


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


# A few recent plans, keyed by the mask tensor (alive, same version) and shapes: every layer of a model shares one.
_PLANS = TensorMemo(8)


def plan(mask: MaskSpec, B: int) -> tuple[list[Part] | None, str | None]:
    """(parts, None) for a varlen call, (None, None) for the dense kernel, or (None, reason) if unsupported."""
    if mask.documents is None and mask.keys is None:
        return None, None
    if mask.documents is not None and mask.keys is not None:
        return None, "documents together with key padding (give padding its own document id instead)"
    source = mask.documents if mask.documents is not None else mask.keys
    if source.device.type == "meta":
        return None, "a mask on the meta device cannot be planned (its values are unknown)"
    extra = (B, mask.T, mask.S, mask.causal, mask.window)
    hit = _PLANS.get(source, *extra)
    if hit is not MISS:
        return hit
    if mask.documents is not None:
        result = (_document_parts(mask, B), None)
    else:
        parts, reason = _key_padding_parts(mask, B)
        result = (None, reason) if reason else (parts, None)
    return _PLANS.put(source, result, *extra)


def _bthd(x: Tensor) -> Tensor:
    """(B, H, T, D) -> the kernel's (B, T, H, D), a view when the last dim is contiguous."""
    x = x.transpose(1, 2)
    return x if x.stride(-1) == 1 else x.contiguous()


def _flat(x: Tensor, index: Tensor | None) -> Tensor:
    """(B, H, T, D) -> varlen rows (n, H, D): all B*T rows, or those in index."""
    x = x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])
    return x if index is None else x.index_select(0, index)


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


class CudaFlashBackend(Backend):
    name = "cuda_flash"

    def supports(self, call: Call) -> str | None:
        if call.device_type != "cuda":
            return f"runs on CUDA only (got {call.device_type})"
        reason = _platform_reason()
        if reason is not None:
            return reason
        if call.dtype not in DTYPES:
            return f"dtype {call.dtype} (float16 or bfloat16 only)"
        if call.D % 8 != 0 or call.D > MAX_HEAD_DIM:
            return f"head dim {call.D} (a multiple of 8, at most {MAX_HEAD_DIM})"
        if min(call.B, call.T, call.S) == 0:
            return f"an empty dimension (B, T, S) = {(call.B, call.T, call.S)}"
        if "dense" in call.mask.kinds:
            return "a dense boolean mask"
        return plan(call.mask, call.B)[1]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, scale: float) -> tuple[Tensor, Tensor]:
        """q: (B, Hq, T, D); k, v: (B, Hkv, S, D) -> out (B, Hq, T, D) q.dtype, lse (B, Hq, T) float32."""
        fwd, _ = _ops()
        B, Hq, T, D = q.shape
        S = k.shape[2]
        causal = _causal(mask)
        parts, reason = plan(mask, B)
        if reason is not None:
            raise ValueError(f"cuda_flash cannot serve this mask: {reason}")
        if parts is None:
            left, right = _window(mask, causal)
            out, lse = fwd(_bthd(q), _bthd(k), _bthd(v), None, None, T, S, 0.0, causal, False, scale=scale,
                           window_size_left=left, window_size_right=right)[:2]
            lse = lse.reshape(B, Hq, T)
            empty = lse.isinf()  # the kernel marks a row that sees no key with lse = +inf; ours is -inf
            return _zero_rows(out.transpose(1, 2), empty, mask), lse.masked_fill(empty, float("-inf"))
        out = q.new_zeros(B * T, Hq, D)
        lse = torch.full((Hq, B * T), float("-inf"), dtype=float_acc(q.dtype), device=q.device)
        for part in parts:
            part = part.to(q.device)
            left, right = _window(mask, part.causal)
            o, l_ = fwd(_flat(q, part.q_index), _flat(k, part.k_index), _flat(v, part.k_index), part.cu_q,
                        part.cu_k, part.max_q, part.max_k, 0.0, part.causal, False, scale=scale,
                        window_size_left=left, window_size_right=right)[:2]
            l_ = l_.reshape(Hq, -1)
            empty = l_.isinf()
            o, l_ = _zero_rows(o, empty.t(), mask), l_.masked_fill(empty, float("-inf"))
            if part.q_index is None:
                out, lse = o, l_
            else:
                out.index_copy_(0, part.q_index, o)
                lse.index_copy_(1, part.q_index, l_)
        return out.view(B, T, Hq, D).transpose(1, 2), lse.view(Hq, B, T).transpose(0, 1)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        """dout, out: (B, Hq, T, D); lse: (B, Hq, T) -> dq (B, Hq, T, D), dk, dv (B, Hkv, S, D)."""
        _, bwd = _ops()
        B, Hq, T, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        causal = _causal(mask)
        rng, unused = _unused(q.device)
        # Back to the kernel's marker for empty rows: with +inf their weights exp(x - lse) are 0, not inf.
        empty = lse == float("-inf")
        lse = lse.to(float_acc(q.dtype)).masked_fill(empty, float("inf"))
        parts, reason = plan(mask, B)
        if reason is not None:
            raise ValueError(f"cuda_flash cannot serve this mask: {reason}")
        if parts is None:
            left, right = _window(mask, causal)
            dq, dk, dv = bwd(_bthd(dout), _bthd(q), _bthd(k), _bthd(v), _bthd(out), lse.contiguous(), None, None,
                             T, S, 0.0, causal, rng, unused, scale=scale, window_size_left=left,
                             window_size_right=right)
            return _zero_rows(dq.transpose(1, 2), empty, mask), dk.transpose(1, 2), dv.transpose(1, 2)
        lse_rows = lse.transpose(0, 1).reshape(Hq, B * T)  # varlen layout (Hq, total)
        dq = q.new_zeros(B * T, Hq, D)
        dkv = None  # (dk, dv) over the flat (B*S) keys, accumulated in float32 when parts share keys
        for part in parts:
            part = part.to(q.device)
            left, right = _window(mask, part.causal)
            rows = lse_rows if part.q_index is None else lse_rows.index_select(1, part.q_index)
            g_q, g_k, g_v = bwd(_flat(dout, part.q_index), _flat(q, part.q_index), _flat(k, part.k_index),
                                _flat(v, part.k_index), _flat(out, part.q_index), rows.contiguous(), part.cu_q,
                                part.cu_k, part.max_q, part.max_k, 0.0, part.causal, rng, unused, scale=scale,
                                window_size_left=left, window_size_right=right)
            g_q = _zero_rows(g_q, rows.isinf().t(), mask)
            if part.q_index is None:
                dq = g_q
            else:
                dq.index_copy_(0, part.q_index, g_q)
            if len(parts) == 1 and part.k_index is None:
                dkv = (g_k, g_v)
                continue
            if dkv is None:
                acc = float_acc(k.dtype) if len(parts) > 1 else k.dtype
                dkv = tuple(torch.zeros(B * S, Hkv, D, dtype=acc, device=k.device) for _ in range(2))
            for full, grad in zip(dkv, (g_k, g_v)):
                if part.k_index is None:
                    full += grad
                else:
                    full.index_add_(0, part.k_index, grad.to(full.dtype))
        back = (lambda x, n: x.view(B, n, x.shape[1], D).transpose(1, 2))  # noqa: E731
        return back(dq, T), back(dkv[0].to(k.dtype), S), back(dkv[1].to(v.dtype), S)
