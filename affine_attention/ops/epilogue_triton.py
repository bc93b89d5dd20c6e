"""The variant epilogue as Triton kernels: one pass forward, one pass backward (imported only when selected), and
the registered operators through which they enter every graph (`OPS`).

The launchers `forward(out, alpha, alpha_ma, m, gate)` and `backward(...)` keep the eager form's contract
(epilogue.py). They are the bodies of two `torch.library.triton_op`s, `affine_attention::epilogue` (with its
backward registered by `register_autograd`) and `affine_attention::epilogue_backward`, and launch through
`wrap_triton`: torch.compile then sees each kernel as a functional node of its graph, with the backward kernel in the
backward graph, instead of a raw launch that writes into a fresh tensor (which dynamo 2.11 silently differentiates
as zero inside an autograd.Function). Every
operand is read through its strides, a broadcast dimension with stride 0, so GQA (m per KV head), a decoding mean
(T = 1), headwise gates and per-head scales need no copy. The backward runs one program per KV head and block of
queries and loops over the query heads of its group, so d m is summed without atomics. Runs on CPU tensors under
TRITON_INTERPRET=1 (the tests), which is how it is checked without a GPU; block sizes are sized for registers
(see FWD_ELEMENTS), not tuned for speed.

Launch geometry (`launch_grid`): axis 0 holds the (batch, head) pairs, since CUDA allows 2^31 - 1 blocks on x but
only 65,535 on y and z (decoding with batch 2048 and 32 heads has 65,536 pairs); the blocks of queries fold over
axes 1 and 2 (block = y + Y * z), as T = 10^7 makes 625,000 of them. Every offset is formed in 64 bits (a
(B, H, T, D) tensor past 2^31 elements is common in training), which tests/test_triton_kernels.py checks in the
compiled IR.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import register_autograd, triton_op
from triton.runtime.interpreter import InterpretedFunction

from .._compat import float_acc
from ._once import once_differentiable

# CUDA's limits on a launch grid, in blocks per axis (x, y, z). Read at each launch, so a test can lower them to
# run the folded path on small tensors.
GRID_LIMITS = (2**31 - 1, 65535, 65535)
# Elements of (B, H, T, D) one program handles with float32 sums: its tile is BLOCK_T x BLOCK_D. The backward keeps
# more tiles live; float64 sums take two registers each, so they get half (see `tile_elements`). Every tile element
# needs its own 64-bit address where D (hence the strides) is not a multiple of 16 and loads cannot be vectorised,
# so registers scale with elements per thread: with 4 warps ptxas spilled (up to 1.9 KB in the backward at 255
# registers for D = 40, and in the forward at its own 80-register target for D = 24), so both run 8 warps.
FWD_ELEMENTS, BWD_ELEMENTS = 4096, 2048
NUM_WARPS = 8
# The PTX .maxnreg directive, at the most a thread may have: without it ptxas picks its own register target for
# occupancy from the block size and spills 8-96 bytes to reach it (seen at 40 to 128 registers). With it no
# specialisation spills on sm_90 (tests/test_triton_kernels.py compiles them all): at most 140 registers where D is
# a multiple of 16, 249 in the backward where it is not (scalar loads: correct, not tuned).
MAXNREG = 255


@triton.jit
def _program_rows(H, T, BLOCK_T: tl.constexpr):
    """This program's batch b, head h and rows t: (BLOCK_T, 1), all int64 (see `launch_grid`).

    Rows past T (the last block, and the programs past the last block where the fold leaves some) are the
    caller's to mask (t < T).
    """
    # pair < 2^31 (launch_grid), so a 32-bit division: a 64-bit one is a long slow path in ptxas (in the forward
    # it cost a stack frame and spills).
    pair = tl.program_id(0)
    b = (pair // H).to(tl.int64)
    h = (pair % H).to(tl.int64)
    block = tl.program_id(1).to(tl.int64) + tl.program_id(2).to(tl.int64) * tl.num_programs(1)
    t = block * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)[:, None]
    return b, h, t


@triton.jit
def _gate(Gt, b, h, t, d, sGb, sGh, sGt, sGd, rows, msk, GATE_D: tl.constexpr):
    """The gate at rows t: (BLOCK_T, BLOCK_D) elementwise (GATE_D), else (BLOCK_T, 1), one value per row (a
    headwise gate or a per-head scale): a tile of addresses fewer, which the tile's registers need."""
    if GATE_D:
        g = tl.load(Gt + b * sGb + h * sGh + t * sGt + d * sGd, mask=msk, other=0.0)
    else:
        g = tl.load(Gt + b * sGb + h * sGh + t * sGt, mask=rows, other=0.0)
    return g


@triton.jit
def _epilogue_fwd(O, A, AMA, M, Gt, Y, T, D, Hq, GRP,
                  sOb, sOh, sOt, sOd, sAb, sAh, sAt, sMb, sMh, sMt, sMd, sGb, sGh, sGt, sGd, sYb, sYh, sYt,
                  AFFINE: tl.constexpr, GATE: tl.constexpr, GATE_D: tl.constexpr, ACC: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # O, Y (B, Hq, T, D); A (B, Hq, T); AMA (Hq,); M (B, Hm, T|1, D) with Hm = Hq / GRP; Gt broadcastable to
    # (B, Hq, T, D).
    b, h, t = _program_rows(Hq, T, BLOCK_T)
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
        y = y * _gate(Gt, b, h, t, d, sGb, sGh, sGt, sGd, rows, msk, GATE_D).to(ACC)
    tl.store(Y + b * sYb + h * sYh + t * sYt + d, y.to(Y.dtype.element_ty), mask=msk)


@triton.jit
def _epilogue_bwd(DY, O, A, AMA, M, Gt, DO, DA, DAMR, DG, DM, T, D, Hm, GRP,
                  sDb, sDh, sDt, sDd, sOb, sOh, sOt, sOd, sAb, sAh, sAt, sMb, sMh, sMt, sMd,
                  sGb, sGh, sGt, sGd,
                  AFFINE: tl.constexpr, GATE: tl.constexpr, GATE_D: tl.constexpr, NEED_DA: tl.constexpr,
                  NEED_DAM: tl.constexpr, NEED_DG: tl.constexpr, NEED_DM: tl.constexpr, ACC: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # Inputs as in the forward, DY like O. Outputs are contiguous: DO (B, Hq, T, D); DA, DAMR and a row-summed DG
    # (B, Hq, T); DG elementwise (B, Hq, T, D); DM (B, Hm, T, D). One program per KV head and block of queries.
    b, hm, t = _program_rows(Hm, T, BLOCK_T)
    d = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]
    rows = t < T
    msk = rows & (d < D)
    if AFFINE:
        m = tl.load(M + b * sMb + hm * sMh + t * sMt + d * sMd, mask=msk, other=0.0).to(ACC)
    dm = tl.zeros((BLOCK_T, BLOCK_D), dtype=ACC)
    # A while loop, not `for j in range(GRP)`: GRP is a runtime int (a constexpr would compile one kernel per group
    # size), and the interpreter turns `range` of a runtime int into int() of a 1-element array, which numpy >= 2.4
    # refuses. The loop runs the same iterations in the same order, so d m sums identically.
    j = 0
    while j < GRP:
        h = hm * GRP + j
        row = (b * Hm * GRP + h) * T + t  # (BLOCK_T, 1) int64 index into the (B, Hq, T) outputs
        g_in = tl.load(DY + b * sDb + h * sDh + t * sDt + d * sDd, mask=msk, other=0.0).to(ACC)
        o = tl.load(O + b * sOb + h * sOh + t * sOt + d * sOd, mask=msk, other=0.0).to(ACC)
        dy = g_in
        if GATE:
            dy = g_in * _gate(Gt, b, h, t, d, sGb, sGh, sGt, sGd, rows, msk, GATE_D).to(ACC)
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
        j += 1
    if NEED_DM:
        tl.store(DM + ((b * Hm + hm) * T + t) * D + d, dm, mask=msk)


def wrap_triton(kernel):
    """torch.library.wrap_triton(kernel): the kernel as a node of any graph traced through it. An interpreted one
    (TRITON_INTERPRET=1, the CPU tests; eager only) is launched as it is, as torch 2.13 does itself and 2.11 refuses."""
    return kernel if isinstance(kernel, InterpretedFunction) else torch.library.wrap_triton(kernel)


def _strides(x: Tensor | None, n: int) -> tuple[int, ...]:
    """x's strides with 0 on broadcast (size-1) dimensions; zeros for an absent operand."""
    if x is None:
        return (0,) * n
    return tuple(0 if size == 1 else stride for size, stride in zip(x.shape, x.stride()))


def _acc(out: Tensor):
    return tl.float64 if float_acc(out.dtype) == torch.float64 else tl.float32


def tile_elements(elements: int, dtype: torch.dtype) -> int:
    """The tile budget for sums in float_acc(dtype): `elements` for float32, half for float64."""
    return elements * 4 // float_acc(dtype).itemsize


def blocks(D: int, elements: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_D): a power of two >= D wide, about `elements` per tile, 1 to 64 rows."""
    block_d = triton.next_power_of_2(D)
    return max(1, min(64, elements // block_d)), block_d


def launch_grid(B: int, H: int, T: int, D: int, elements: int,
                limits: tuple[int, int, int] = GRID_LIMITS) -> tuple[tuple[int, int, int], int, int]:
    """(grid, BLOCK_T, BLOCK_D) for one program per (batch, head) pair and block of BLOCK_T rows.

    Axis 0: the B * H pairs (x allows 2^31 - 1). The N = cdiv(T, BLOCK_T) blocks of queries fold over axes 1 and
    2 (65,535 each): Z = cdiv(N, limit_y) slices of Y = cdiv(N, Z) blocks, block = y + Y * z; the Y * Z - N < Z
    blocks past the last one have no rows (masked off by t < T). A pure function of the sizes (limits: CUDA's,
    or lower in tests). Raises ValueError past 2^31 - 1 pairs or 65,535^2 blocks of queries (T past 6 * 10^10 at
    D = 256): no such tensor fits in a GPU's memory with a useful head dimension.
    """
    block_t, block_d = blocks(D, elements)
    n_t = triton.cdiv(T, block_t)
    z = triton.cdiv(n_t, limits[1])
    grid = (B * H, triton.cdiv(n_t, z), z)
    if any(n > limit for n, limit in zip(grid, limits)):
        raise ValueError(f"the epilogue's launch grid {grid} for (B, H, T, D) = {(B, H, T, D)} exceeds the grid "
                         f"limits {limits}")
    return grid, block_t, block_d


def forward(out: Tensor, alpha: Tensor | None, alpha_ma: Tensor | None, m: Tensor | None,
            gate: Tensor | None) -> Tensor:
    """out: (B, Hq, T, D); alpha (B, Hq, T); alpha_ma (Hq,); m (B, Hm, T|1, D); gate rank 4, broadcastable.
    Returns y: (B, Hq, T, D) in out's dtype, contiguous."""
    B, Hq, T, D = out.shape
    y = torch.empty((B, Hq, T, D), dtype=out.dtype, device=out.device)
    affine = alpha is not None
    if y.numel() == 0:
        return y
    grp = Hq // m.shape[1] if affine else 1
    grid, block_t, block_d = launch_grid(B, Hq, T, D, tile_elements(FWD_ELEMENTS, out.dtype), GRID_LIMITS)
    dummy = out  # never read: its AFFINE / GATE flag is off
    wrap_triton(_epilogue_fwd)[grid](
        out, alpha if affine else dummy, alpha_ma if affine else dummy, m if affine else dummy,
        gate if gate is not None else dummy, y, T, D, Hq, grp,
        *_strides(out, 4), *_strides(alpha, 3), *_strides(m, 4), *_strides(gate, 4), *y.stride()[:3],
        AFFINE=affine, GATE=gate is not None, GATE_D=gate is not None and gate.shape[-1] != 1, ACC=_acc(out),
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=NUM_WARPS, maxnreg=MAXNREG)
    return y


def backward(grad: Tensor, out: Tensor, alpha: Tensor | None, alpha_ma: Tensor | None, m: Tensor | None,
             gate: Tensor | None, *, need_alpha: bool, need_alpha_ma: bool, need_gate: bool, need_m: bool):
    """(d out, d alpha, d alpha_ma, d gate, d m), each None where not needed; d m is reduced to m's shape.
    grad, out: (B, Hq, T, D); the rest as in `forward`."""
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
        grid, block_t, block_d = launch_grid(B, Hm, T, D, tile_elements(BWD_ELEMENTS, out.dtype), GRID_LIMITS)
        dummy = out
        wrap_triton(_epilogue_bwd)[grid](
            grad, out, *(x if x is not None else dummy for x in (alpha, alpha_ma, m, gate)), d_out,
            *(x if x is not None else dummy for x in (d_alpha, d_am_rows, d_gate, d_m)), T, D, Hm, Hq // Hm,
            *_strides(grad, 4), *_strides(out, 4), *_strides(alpha, 3), *_strides(m, 4),
            *_strides(gate, 4),
            AFFINE=affine, GATE=gate is not None, GATE_D=gate_d, NEED_DA=need_alpha, NEED_DAM=need_alpha_ma,
            NEED_DG=need_gate, NEED_DM=need_m, ACC=_acc(out), BLOCK_T=block_t, BLOCK_D=block_d,
            num_warps=NUM_WARPS, maxnreg=MAXNREG)
    elif need_m:
        d_m.zero_()
    if need_gate:
        d_gate = d_gate.view(rows + (D if gate_d else 1,)).sum_to_size(gate.shape).to(gate.dtype)
    return (d_out, None if d_alpha is None else d_alpha.to(alpha.dtype),
            None if d_am_rows is None else d_am_rows.sum((0, 2)).to(alpha_ma.dtype),
            d_gate, None if d_m is None else d_m.sum_to_size(m.shape).to(m.dtype))


# ---------------------------------------------------------------------------------------------------------------
# The registered operators. Their schemas take no None gradient back, so the backward returns an empty tensor in
# place of each gradient not asked for; `OPS.backward` turns those into None again, from the same flags.

@triton_op("affine_attention::epilogue", mutates_args=())
def _epilogue_op(out: Tensor, alpha: Tensor | None, alpha_ma: Tensor | None, m: Tensor | None,
                 gate: Tensor | None) -> Tensor:
    """y (B, Hq, T, D) from out (B, Hq, T, D), alpha (B, Hq, T), alpha_ma (Hq,), m (B, Hm, T|1, D), gate rank 4."""
    return forward(out, alpha, alpha_ma, m, gate)


@triton_op("affine_attention::epilogue_backward", mutates_args=())
def _epilogue_backward_op(grad: Tensor, out: Tensor, alpha: Tensor | None, alpha_ma: Tensor | None, m: Tensor | None,
                          gate: Tensor | None, need_alpha: bool, need_alpha_ma: bool, need_gate: bool,
                          need_m: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d out, d alpha, d alpha_ma, d gate, d m), each in its input's shape, or (0,) where not needed; grad like out."""
    grads = backward(grad, out, alpha, alpha_ma, m, gate, need_alpha=need_alpha, need_alpha_ma=need_alpha_ma,
                     need_gate=need_gate, need_m=need_m)
    return tuple(out.new_empty(0) if g is None else g for g in grads)


class OPS:
    """The epilogue.py contract (forward, backward) through the registered operators: what the package calls."""

    @staticmethod
    def forward(out: Tensor, alpha: Tensor | None, alpha_ma: Tensor | None, m: Tensor | None,
                gate: Tensor | None) -> Tensor:
        """As `forward`; differentiable (the registered backward) where an input requires grad."""
        return torch.ops.affine_attention.epilogue(out, alpha, alpha_ma, m, gate)

    @staticmethod
    def backward(grad: Tensor, out: Tensor, alpha: Tensor | None, alpha_ma: Tensor | None, m: Tensor | None,
                 gate: Tensor | None, *, need_alpha: bool, need_alpha_ma: bool, need_gate: bool, need_m: bool):
        """As `backward`: (d out, d alpha, d alpha_ma, d gate, d m), each None where not needed."""
        affine = alpha is not None
        needs = (True, affine and need_alpha, affine and need_alpha_ma, gate is not None and need_gate,
                 affine and need_m)
        grads = torch.ops.affine_attention.epilogue_backward(grad, out, alpha, alpha_ma, m, gate, needs[1], needs[2],
                                                             needs[3], needs[4])
        return tuple(g if need else None for g, need in zip(grads, needs))


def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)  # out, alpha, alpha_ma, m, gate: held by other nodes anyway


@once_differentiable("the variant epilogue")  # a second derivative raises, naming what to use instead
def _differentiate(ctx, grad):
    """grad (B, Hq, T, D) -> gradients in the operator's argument order (out, alpha, alpha_ma, m, gate)."""
    out, alpha, alpha_ma, m, gate = ctx.saved_tensors
    need = ctx.needs_input_grad
    d_out, d_alpha, d_alpha_ma, d_gate, d_m = OPS.backward(grad, out, alpha, alpha_ma, m, gate, need_alpha=need[1],
                                                           need_alpha_ma=need[2], need_gate=need[4], need_m=need[3])
    return d_out if need[0] else None, d_alpha, d_alpha_ma, d_m, d_gate


register_autograd("affine_attention::epilogue", _differentiate, setup_context=_save_inputs)
