"""The non-finite guarantee (nonfinite.py) as two fused Triton passes on CUDA: one over k and v that writes their
isolated copies and each key row's flag, one over the output that tests q and alpha and writes nan where the rule
says. Registered operators, so that compiled graphs hold them as nodes with their backward (`OPS`).

`isolate_rows` reads k and v once where the torch path reads them twice (aminmax, then masked_fill) and writes the
copies and the (B, Hkv, S) flags in the same pass; `seen` is then a prefix sum over flags, not over (S, D) rows.
`poison` tests each q row, alpha and `seen` and masks the output in one pass, where the torch path reads q, builds
the (B, Hq, T) mask and then passes over the output. Both backwards are the masked_fill backward of the torch path
(zero gradient on every zeroed row), written with torch ops, so they stay differentiable. A row is finite where
x - x == 0 holds for every entry (nan - nan and inf - inf are nan), in float32 for half types and in the tensor's
own dtype otherwise: no downcast rounds a finite float64 to inf. Launch geometry and 64-bit indexing are the epilogue's
(epilogue_triton.launch_grid, `_program_rows`); runs on CPU under TRITON_INTERPRET=1, which is how it is tested.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import register_autograd, triton_op

from . import epilogue_triton as et
from .epilogue_triton import FWD_ELEMENTS, MAXNREG, NUM_WARPS, _program_rows, _strides, launch_grid, tile_elements


@triton.jit
def _wide(x):
    """Half types widened to float32 (exact; the interpreter does no bfloat16 arithmetic), others as they are: no
    downcast rounds a finite float64 to inf."""
    if x.dtype == tl.float16 or x.dtype == tl.bfloat16:
        x = x.to(tl.float32)
    return x


@triton.jit
def _nonfinite(x):
    """Elementwise: True where x is nan or inf."""
    x = _wide(x)
    return (x - x) != 0


@triton.jit
def _any_nonfinite(x):
    """x: (BLOCK, BLOCK_D) -> (BLOCK, 1) bool, True where a row holds a nan or inf (masked-off entries load 0)."""
    return tl.max(tl.where(_nonfinite(x), 1, 0), axis=1)[:, None] > 0


@triton.jit
def _isolate_kernel(K, V, KEEP, KO, VO, BAD, S, D, H,
                    sKb, sKh, sKs, sKd, sVb, sVh, sVs, sVd, sPb, sPs,
                    WRITE: tl.constexpr, PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # K, V (B, H, S, D) any strides; KEEP (B|1, S) bool, False on a padded key; KO, VO (B, H, S, D) and BAD (B, H, S)
    # contiguous. One program per (batch, KV head) and block of key rows.
    b, h, s = _program_rows(H, S, BLOCK_T)
    d = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]
    rows = s < S
    msk = rows & (d < D)
    k = tl.load(K + b * sKb + h * sKh + s * sKs + d * sKd, mask=msk, other=0.0)
    v = tl.load(V + b * sVb + h * sVh + s * sVs + d * sVd, mask=msk, other=0.0)
    bad = _any_nonfinite(k) | _any_nonfinite(v)
    row = (b * H + h) * S + s  # (BLOCK_T, 1) int64 index into the (B, H, S) flags
    tl.store(BAD + row, bad, mask=rows)
    if WRITE:
        zero = bad
        if PAD:
            zero = zero | (tl.load(KEEP + b * sPb + s * sPs, mask=rows, other=1) == 0)
        tl.store(KO + row * D + d, tl.where(zero, 0.0, k).to(KO.dtype.element_ty), mask=msk)
        tl.store(VO + row * D + d, tl.where(zero, 0.0, v).to(VO.dtype.element_ty), mask=msk)


@triton.jit
def _poison_kernel(O, Q, A, SEEN, Y, HIT, T, D, Hq, GRP,
                   sOb, sOh, sOt, sOd, sQb, sQh, sQt, sQd, sAb, sAh, sAt, sSb, sSh, sSt,
                   ALPHA: tl.constexpr, SEEN_ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # O, Q (B, Hq, T, D) any strides; A (B, Hq, T); SEEN (B, Hq / GRP, T|1) bool; Y (B, Hq, T, D) and HIT (B, Hq, T)
    # contiguous. One program per (batch, query head) and block of queries.
    b, h, t = _program_rows(Hq, T, BLOCK_T)
    d = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]
    rows = t < T
    msk = rows & (d < D)
    hit = _any_nonfinite(tl.load(Q + b * sQb + h * sQh + t * sQt + d * sQd, mask=msk, other=0.0))
    if ALPHA:
        a = tl.load(A + b * sAb + h * sAh + t * sAt, mask=rows, other=0.0)
        hit = hit | _nonfinite(a)
    if SEEN_ROWS:
        hit = hit | (tl.load(SEEN + b * sSb + (h // GRP) * sSh + t * sSt, mask=rows, other=0) != 0)
    o = tl.load(O + b * sOb + h * sOh + t * sOt + d * sOd, mask=msk, other=0.0)
    row = (b * Hq + h) * T + t
    tl.store(HIT + row, hit, mask=rows)
    tl.store(Y + row * D + d, tl.where(hit, float("nan"), _wide(o)).to(Y.dtype.element_ty), mask=msk)


def _keep(keys: Tensor | None, like: Tensor) -> tuple[Tensor, int, int]:
    """keys (B|1, 1, 1, S) bool or None -> (the tensor the kernel reads, its batch and key strides)."""
    if keys is None:
        return like, 0, 0  # never read: PAD is off
    strides = _strides(keys, 4)
    return keys, strides[0], strides[3]


def isolate_rows(k: Tensor, v: Tensor, keys: Tensor | None, write: bool) -> tuple[Tensor, Tensor, Tensor]:
    """k, v: (B, Hkv, S, D); keys: (B|1, 1, 1, S) bool (False: padded) or None -> (k0, v0, bad): bad (B, Hkv, S) bool,
    True where the key row or the value row holds a nan or inf; k0, v0 (B, Hkv, S, D) contiguous copies with every
    bad or padded row set to 0 (write), or empty (0,) tensors (not write: the flags alone)."""
    B, H, S, D = k.shape
    bad = torch.empty((B, H, S), dtype=torch.bool, device=k.device)
    shape = (B, H, S, D) if write else (0,)
    k0, v0 = torch.empty(shape, dtype=k.dtype, device=k.device), torch.empty(shape, dtype=v.dtype, device=v.device)
    if bad.numel() == 0:
        return k0, v0, bad
    grid, block_t, block_d = launch_grid(B, H, S, D, tile_elements(FWD_ELEMENTS, k.dtype))
    keep, sPb, sPs = _keep(keys, bad)
    et.wrap_triton(_isolate_kernel)[grid](
        k, v, keep, k0 if write else k, v0 if write else v, bad, S, D, H, *_strides(k, 4), *_strides(v, 4), sPb, sPs,
        WRITE=write, PAD=write and keys is not None, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=NUM_WARPS,
        maxnreg=MAXNREG)
    return k0, v0, bad


def poison(out: Tensor, q: Tensor, alpha: Tensor | None, seen: Tensor | None) -> tuple[Tensor, Tensor]:
    """out, q: (B, Hq, T, D); alpha: (B, Hq, T) or None; seen: (B, Hkv|Hq, T|1) bool or None -> (y, hit): hit
    (B, Hq, T) bool, True for a query whose q row or alpha is non-finite or that saw a non-finite key or value row
    (seen, broadcast over each group of Hq // Hkv query heads); y (B, Hq, T, D) contiguous, out with nan on hit rows."""
    B, Hq, T, D = out.shape
    y = torch.empty((B, Hq, T, D), dtype=out.dtype, device=out.device)
    hit = torch.empty((B, Hq, T), dtype=torch.bool, device=out.device)
    if hit.numel() == 0:
        return y, hit
    grid, block_t, block_d = launch_grid(B, Hq, T, D, tile_elements(FWD_ELEMENTS, out.dtype))
    et.wrap_triton(_poison_kernel)[grid](
        out, q, alpha if alpha is not None else out, seen if seen is not None else hit, y, hit, T, D, Hq,
        Hq // seen.shape[1] if seen is not None else 1, *_strides(out, 4), *_strides(q, 4), *_strides(alpha, 3), *_strides(seen, 3),
        ALPHA=alpha is not None, SEEN_ROWS=seen is not None, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=NUM_WARPS,
        maxnreg=MAXNREG)
    return y, hit


# ---------------------------------------------------------------------------------------------------------------
# The registered operators and their backward: the gradient of a zeroed (or nan) row is 0, as masked_fill's is.

@triton_op("affine_attention::isolate_rows", mutates_args=())
def _isolate_op(k: Tensor, v: Tensor, keys: Tensor | None, write: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(k0, v0, bad) as `isolate_rows`."""
    return isolate_rows(k, v, keys, write)


@triton_op("affine_attention::poison", mutates_args=())
def _poison_op(out: Tensor, q: Tensor, alpha: Tensor | None, seen: Tensor | None) -> tuple[Tensor, Tensor]:
    """(y, hit) as `poison`."""
    return poison(out, q, alpha, seen)


def _save_isolate(ctx, inputs, output) -> None:
    keys = inputs[2]
    ctx.save_for_backward(output[2], keys)


def _isolate_backward(ctx, dk0, dv0, _dbad):
    """d k0, d v0 (B, Hkv, S, D) -> (d k, d v, None, None): zero on every row the forward zeroed."""
    bad, keys = ctx.saved_tensors
    zero = bad[..., None] if keys is None else bad[..., None] | ~keys.reshape(keys.shape[0], 1, -1, 1)
    return dk0.masked_fill(zero, 0), dv0.masked_fill(zero, 0), None, None


def _save_poison(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1])


def _poison_backward(ctx, dy, _dhit):
    """dy (B, Hq, T, D) -> (d out, None, None, None): zero on every query the forward made nan."""
    hit, = ctx.saved_tensors
    return dy.masked_fill(hit[..., None], 0), None, None, None


register_autograd("affine_attention::isolate_rows", _isolate_backward, setup_context=_save_isolate)
register_autograd("affine_attention::poison", _poison_backward, setup_context=_save_poison)


class OPS:
    """What nonfinite.py calls on CUDA: the registered operators, differentiable where k, v or out require grad."""

    @staticmethod
    def nonfinite_rows(k: Tensor, v: Tensor) -> Tensor:
        """k, v: (B, Hkv, S, D) -> (B, Hkv, S) bool, True where the key or value row holds a nan or inf."""
        return torch.ops.affine_attention.isolate_rows(k.detach(), v.detach(), None, False)[2]

    @staticmethod
    def isolate(k: Tensor, v: Tensor, keys: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """(k0, v0, bad) as `isolate_rows` with write=True."""
        return torch.ops.affine_attention.isolate_rows(k, v, keys, True)

    @staticmethod
    def poison(out: Tensor, q: Tensor, alpha: Tensor | None, seen: Tensor | None) -> Tensor:
        """out with nan on every hit query, as `poison`, seen as `nonfinite.isolate` gives it (B, Hkv|Hq, T|1, 1);
        q and alpha are read, never differentiated."""
        seen = None if seen is None else seen.reshape(seen.shape[:3])
        return torch.ops.affine_attention.poison(out, q.detach(), None if alpha is None else alpha.detach(), seen)[0]
