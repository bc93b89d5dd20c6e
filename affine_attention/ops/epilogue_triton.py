"""The variant epilogue as Triton kernels: one pass forward, one pass backward (imported only when selected).

Same contract as the eager form in epilogue.py: forward(out, alpha, alpha_ma, m, gate) and backward(...). Every
operand is read through its strides, a broadcast dimension with stride 0, so GQA (m per KV head), a decoding mean
(T = 1), headwise gates and per-head scales need no copy. The backward runs one program per KV head and block of
queries and loops over the query heads of its group, so d m is summed without atomics. Runs on CPU tensors under
TRITON_INTERPRET=1 (the tests), which is how it is checked without a GPU; block sizes are untuned.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._compat import float_acc


@triton.jit
def _epilogue_fwd(O, A, AMA, M, Gt, Y, T, D, Hq, GRP,
                  sOb, sOh, sOt, sOd, sAb, sAh, sAt, sMb, sMh, sMt, sMd, sGb, sGh, sGt, sGd, sYb, sYh, sYt,
                  AFFINE: tl.constexpr, GATE: tl.constexpr, ACC: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]  # (BLOCK_T, 1)
    d = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]  # (1, BLOCK_D)
    rows = t < T
    msk = rows & (d < D)
    y = tl.load(O + b * sOb + h * sOh + t * sOt + d * sOd, mask=msk, other=0.0).to(ACC)
    if AFFINE:
        a = tl.load(A + b * sAb + h * sAh + t * sAt, mask=rows, other=0.0).to(ACC)
        ama = tl.load(AMA + h).to(ACC)
        m = tl.load(M + b * sMb + (h // GRP) * sMh + t * sMt + d * sMd, mask=msk, other=0.0).to(ACC)
        y = a * y + (ama - a) * m
    if GATE:
        y = y * tl.load(Gt + b * sGb + h * sGh + t * sGt + d * sGd, mask=msk, other=0.0).to(ACC)
    tl.store(Y + b * sYb + h * sYh + t * sYt + d, y.to(Y.dtype.element_ty), mask=msk)


@triton.jit
def _epilogue_bwd(DY, O, A, AMA, M, Gt, DO, DA, DAMR, DG, DM, T, D, Hm, GRP,
                  sDb, sDh, sDt, sDd, sOb, sOh, sOt, sOd, sAb, sAh, sAt, sMb, sMh, sMt, sMd,
                  sGb, sGh, sGt, sGd,
                  AFFINE: tl.constexpr, GATE: tl.constexpr, GATE_D: tl.constexpr, NEED_DA: tl.constexpr,
                  NEED_DAM: tl.constexpr, NEED_DG: tl.constexpr, NEED_DM: tl.constexpr, ACC: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # Outputs are contiguous: DO (B, Hq, T, D); DA, DAMR and a row-summed DG (B, Hq, T); DG elementwise
    # (B, Hq, T, D); DM (B, Hm, T, D).
    pid_bm = tl.program_id(1)
    b = (pid_bm // Hm).to(tl.int64)
    hm = (pid_bm % Hm).to(tl.int64)
    Hq = Hm * GRP
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]
    rows = t < T
    msk = rows & (d < D)
    if AFFINE:
        m = tl.load(M + b * sMb + hm * sMh + t * sMt + d * sMd, mask=msk, other=0.0).to(ACC)
    dm = tl.zeros((BLOCK_T, BLOCK_D), dtype=ACC)
    for j in range(GRP):
        h = hm * GRP + j
        row = (b * Hq + h) * T + t  # (BLOCK_T, 1) index into the (B, Hq, T) outputs
        g_in = tl.load(DY + b * sDb + h * sDh + t * sDt + d * sDd, mask=msk, other=0.0).to(ACC)
        o = tl.load(O + b * sOb + h * sOh + t * sOt + d * sOd, mask=msk, other=0.0).to(ACC)
        dy = g_in
        if GATE:
            dy = g_in * tl.load(Gt + b * sGb + h * sGh + t * sGt + d * sGd, mask=msk, other=0.0).to(ACC)
        y = o
        if AFFINE:
            a = tl.load(A + b * sAb + h * sAh + t * sAt, mask=rows, other=0.0).to(ACC)
            ama = tl.load(AMA + h).to(ACC)
            tl.store(DO + row * D + d, (a * dy).to(DO.dtype.element_ty), mask=msk)
            if NEED_DA:
                tl.store(DA + row, tl.sum(dy * (o - m), axis=1)[:, None], mask=rows)
            if NEED_DAM:
                tl.store(DAMR + row, tl.sum(dy * m, axis=1)[:, None], mask=rows)
            if NEED_DM:
                dm += (ama - a) * dy
            if NEED_DG:
                y = a * o + (ama - a) * m
        else:
            tl.store(DO + row * D + d, dy.to(DO.dtype.element_ty), mask=msk)
        if NEED_DG:
            if GATE_D:
                tl.store(DG + row * D + d, g_in * y, mask=msk)
            else:
                tl.store(DG + row, tl.sum(g_in * y, axis=1)[:, None], mask=rows)
    if NEED_DM:
        tl.store(DM + ((b * Hm + hm) * T + t) * D + d, dm, mask=msk)


def _strides(x: Tensor | None, n: int) -> tuple[int, ...]:
    """x's strides with 0 on broadcast (size-1) dimensions; zeros for an absent operand."""
    if x is None:
        return (0,) * n
    return tuple(0 if size == 1 else stride for size, stride in zip(x.shape, x.stride()))


def _acc(out: Tensor):
    return tl.float64 if float_acc(out.dtype) == torch.float64 else tl.float32


def _blocks(D: int, elements: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(D)
    return max(1, min(64, elements // block_d)), block_d


def forward(out: Tensor, alpha: Tensor | None, alpha_ma: Tensor | None, m: Tensor | None,
            gate: Tensor | None, inv: Tensor | None = None, m_owned: bool = False) -> Tensor:
    """out: (B, Hq, T, D); alpha (B, Hq, T); alpha_ma (Hq,); m (B, Hm, T|1, D); gate rank 4, broadcastable.
    inv: (B|1, 1, T|1, 1) when m holds the undivided sums (the mean is m * inv, formed here; in place when
    m_owned)."""
    if inv is not None:
        m = m.mul_(inv) if m_owned else m * inv
    B, Hq, T, D = out.shape
    y = torch.empty((B, Hq, T, D), dtype=out.dtype, device=out.device)
    affine = alpha is not None
    if y.numel() == 0:
        return y
    grp = Hq // m.shape[1] if affine else 1
    block_t, block_d = _blocks(D, 4096)
    dummy = out  # never read: its AFFINE / GATE flag is off
    _epilogue_fwd[(triton.cdiv(T, block_t), B * Hq)](
        out, alpha if affine else dummy, alpha_ma if affine else dummy, m if affine else dummy,
        gate if gate is not None else dummy, y, T, D, Hq, grp,
        *_strides(out, 4), *_strides(alpha, 3), *_strides(m, 4), *_strides(gate, 4), *y.stride()[:3],
        AFFINE=affine, GATE=gate is not None, ACC=_acc(out), BLOCK_T=block_t, BLOCK_D=block_d)
    return y


def backward(grad: Tensor, out: Tensor, alpha: Tensor | None, alpha_ma: Tensor | None, m: Tensor | None,
             gate: Tensor | None, *, need_alpha: bool, need_alpha_ma: bool, need_gate: bool, need_m: bool,
             m_scratch: bool = False, inv: Tensor | None = None):
    """(d out, d alpha, d alpha_ma, d gate, d m), each None where not needed; d m is reduced to m's shape.
    inv as in `forward` (then d m is the gradient of the sums); m_scratch: m may be overwritten."""
    if inv is not None:
        m = m.mul_(inv) if m_scratch else m * inv
        d = backward(grad, out, alpha, alpha_ma, m, gate, need_alpha=need_alpha, need_alpha_ma=need_alpha_ma,
                     need_gate=need_gate, need_m=need_m)
        return d[:4] + (None if d[4] is None else d[4].mul_(inv),)
    B, Hq, T, D = out.shape
    acc = float_acc(out.dtype)
    affine = alpha is not None
    need_alpha, need_alpha_ma, need_m = (affine and need_alpha, affine and need_alpha_ma, affine and need_m)
    need_gate = gate is not None and need_gate
    gate_d = gate is not None and gate.shape[-1] != 1
    Hm = m.shape[1] if affine else Hq
    dev = out.device
    d_out = torch.empty((B, Hq, T, D), dtype=out.dtype, device=dev)
    rows = (B, Hq, T)
    d_alpha = torch.empty(rows, dtype=acc, device=dev) if need_alpha else None
    d_am_rows = torch.empty(rows, dtype=acc, device=dev) if need_alpha_ma else None
    d_gate = torch.empty(rows + ((D,) if gate_d else ()), dtype=acc, device=dev) if need_gate else None
    d_m = torch.empty((B, Hm, T, D), dtype=acc, device=dev) if need_m else None
    if d_out.numel():
        block_t, block_d = _blocks(D, 2048)
        dummy = out
        _epilogue_bwd[(triton.cdiv(T, block_t), B * Hm)](
            grad, out, *(x if x is not None else dummy for x in (alpha, alpha_ma, m, gate)), d_out,
            *(x if x is not None else dummy for x in (d_alpha, d_am_rows, d_gate, d_m)), T, D, Hm, Hq // Hm,
            *_strides(grad, 4), *_strides(out, 4), *_strides(alpha, 3), *_strides(m, 4), *_strides(gate, 4),
            AFFINE=affine, GATE=gate is not None, GATE_D=gate_d, NEED_DA=need_alpha, NEED_DAM=need_alpha_ma,
            NEED_DG=need_gate, NEED_DM=need_m, ACC=_acc(out), BLOCK_T=block_t, BLOCK_D=block_d)
    elif need_m:
        d_m.zero_()
    if need_gate:
        d_gate = d_gate.view(rows + (D if gate_d else 1,)).sum_to_size(gate.shape).to(gate.dtype)
    return (d_out, None if d_alpha is None else d_alpha.to(alpha.dtype),
            None if d_am_rows is None else d_am_rows.sum((0, 2)).to(alpha_ma.dtype),
            d_gate, None if d_m is None else d_m.sum_to_size(m.shape).to(m.dtype))
