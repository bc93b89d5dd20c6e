"""The variant epilogue: out = g * (a * O + (alpha_ma - a) * m) in one pass with a hand-written backward.

O is a softmax kernel's output, m the mean of visible V (affine's bias term), a = alpha, g an output gate or a
per-head scale; every part is optional. One autograd.Function serves affine, gated, affine_gated and
scaled_softmax (the sink lives in the kernel, see backends/base.py). It saves only tensors other nodes hold anyway
(O, V, alpha, the gate): for prefix-sum masks the mean of V is recomputed in backward instead of being saved. On
CUDA the combine runs as one Triton kernel (epilogue_triton.py); on CPU as a few in-place eager passes. The choice
is explicit: `impl=` or `use_epilogue(...)` forces one, and a forced implementation that cannot run raises.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from .._compat import float_acc
from ._forcing import ForcedChoice
from .value_mean import ValueMean

IMPLS = ("eager", "triton")


def _check_impl_name(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"epilogue impl must be one of {IMPLS} (or None: triton on CUDA, eager elsewhere), "
                         f"got {impl!r}")


_forced = ForcedChoice(_check_impl_name)


def use_epilogue(impl: str | None):
    """Force every epilogue in this block (this thread) onto `impl` ("eager" or "triton"; None: by device)."""
    return _forced.use(impl)


def select_impl(device: torch.device, impl: str | None = None) -> str:
    """The implementation that runs on `device`: the forced one, else triton on CUDA and eager elsewhere.

    A forced "triton" off CUDA needs the interpreter (TRITON_INTERPRET=1); a missing triton package raises.
    """
    name = impl if impl is not None else _forced.current
    if name is None:
        name = "triton" if device.type == "cuda" else "eager"
    _check_impl_name(name)
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the triton epilogue runs on CUDA tensors (got {device.type}); on CPU it runs only "
                             "under the interpreter (set TRITON_INTERPRET=1 before importing triton) or pass "
                             "impl='eager'")
        try:
            from . import epilogue_triton  # noqa: F401  (lazy: triton is imported only when used)
        except ImportError as e:
            raise ValueError(f"the triton epilogue needs the `triton` package ({e}); install it or force the "
                             "eager epilogue with impl='eager' / use_epilogue('eager')") from e
    return name


def _gate4(gate: Tensor | float | None, out: Tensor) -> Tensor | None:
    """The gate as a rank-4 tensor broadcastable to out (B, Hq, T, D), each dimension 1 or full."""
    if gate is None:
        return None
    if isinstance(gate, (int, float)) and not isinstance(gate, bool):
        return torch.full((1, 1, 1, 1), float(gate), dtype=float_acc(out.dtype), device=out.device)
    if not isinstance(gate, Tensor) or not gate.is_floating_point():
        raise ValueError(f"gate must be a float or a floating-point tensor broadcastable to (B, Hq, T, D), got "
                         f"{type(gate).__name__ if not isinstance(gate, Tensor) else gate.dtype}")
    if gate.dim() != 4 or any(g not in (1, o) for g, o in zip(gate.shape, out.shape)):
        raise ValueError(f"gate must have rank 4 with each dimension 1 or that of (B, Hq, T, D) = "
                         f"{tuple(out.shape)}, e.g. (B, Hq, T, D) elementwise, (B, Hq, T, 1) per head, "
                         f"(1, Hq, 1, 1) a per-head scale; got {tuple(gate.shape)}")
    if gate.device != out.device:
        raise ValueError(f"gate is on {gate.device} but the attention output is on {out.device}")
    return gate


def _check_affine(out: Tensor, alpha: Tensor, alpha_ma: Tensor, m_shape: tuple[int, ...]) -> None:
    B, Hq, T, D = out.shape
    if tuple(alpha.shape) != (B, Hq, T):
        raise ValueError(f"alpha must have shape (B, Hq, T) = {(B, Hq, T)}, got {tuple(alpha.shape)}")
    if tuple(alpha_ma.shape) != (Hq,):
        raise ValueError(f"alpha_ma must have shape (Hq,) = ({Hq},), got {tuple(alpha_ma.shape)}")
    if len(m_shape) != 4 or m_shape[0] != B or m_shape[3] != D or m_shape[2] not in (1, T) or m_shape[1] < 1 \
            or Hq % m_shape[1]:
        raise ValueError(f"the mean of V must have shape (B, Hkv, T|1, D) with Hq = {Hq} a multiple of Hkv, "
                         f"B = {B}, T = {T}, D = {D}; got {tuple(m_shape)}")


def epilogue(out: Tensor, *, alpha: Tensor | None = None, alpha_ma: Tensor | None = None,
             v_mean: Tensor | None = None, v: Tensor | None = None, mean: ValueMean | None = None,
             gate: Tensor | float | None = None, impl: str | None = None) -> Tensor:
    """g * (alpha * out + (alpha_ma - alpha) * m), or g * out without alpha, in one pass; returns out's dtype.

    out: (B, Hq, T, D) kernel output. alpha: (B, Hq, T); alpha_ma: (Hq,). The mean m comes either precomputed,
    v_mean: (B, Hkv|Hq, T|1, D) (broadcast over each group of Hq // Hkv query heads without a copy), or as
    v: (B, Hkv, S, D) with `mean` (a ValueMean) mapping v to it, which lets backward recompute m from v instead
    of saving it. gate: broadcastable to (B, Hq, T, D) (elementwise (B, Hq, T, D), headwise (B, Hq, T, 1), a
    per-head scale (1, Hq, 1, 1)) or a constant float. Sums accumulate in float32 (float64 for float64).
    impl: "eager" or "triton" (default: triton on CUDA, eager elsewhere; see select_impl).

    This is the entry point to time against a flash kernel (benchmarks/gpu_check.py): e.g.
    epilogue(o, alpha=a, alpha_ma=am, v_mean=m, gate=g, impl="triton").
    """
    if not isinstance(out, Tensor) or out.dim() != 4:
        raise ValueError(f"out must be the (B, Hq, T, D) attention output, got "
                         f"{tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__}")
    g = _gate4(gate, out)
    if alpha is None:
        if alpha_ma is not None or v_mean is not None or v is not None:
            raise ValueError("alpha_ma, v_mean and v belong to the affine part: pass alpha with them, or none")
        if g is None:
            return out
    else:
        if alpha_ma is None:
            raise ValueError("alpha needs alpha_ma: (Hq,), the running mean of alpha")
        if (v_mean is None) == (v is None) or (v is not None and not isinstance(mean, ValueMean)):
            raise ValueError("the affine epilogue needs the mean of visible V: pass exactly one of v_mean "
                             "(B, Hkv, T|1, D) or v (B, Hkv, S, D) together with mean=ValueMean(...)")
        if v is not None and not mean.has_transpose:
            raise ValueError("v with mean= recomputes the mean in backward only for prefix-sum masks (none, causal "
                             "with T <= S, key padding); for this mask pass v_mean=mean(v) (autograd keeps it)")
        if v_mean is not None:
            _check_affine(out, alpha, alpha_ma, tuple(v_mean.shape))
    name = select_impl(out.device, impl)
    return _Epilogue.apply(name, out, alpha, alpha_ma, g, v_mean, v, mean)


def _kernels(name: str):
    if name == "triton":
        from . import epilogue_triton
        return epilogue_triton
    return _eager


class _Epilogue(torch.autograd.Function):
    """Forward through one implementation; backward recomputes m from v (when given so), calls the same one, and
    maps d m to d v through the mean's hand-written transpose."""

    @staticmethod
    def forward(ctx, name, out, alpha, alpha_ma, gate, v_mean, v, mean):
        m = v_mean if v is None else mean.value(v)[0]
        if alpha is not None and v is not None:
            _check_affine(out, alpha, alpha_ma, tuple(m.shape))
        res = _kernels(name).forward(out, alpha, alpha_ma, m, gate)
        # Every saved tensor is an input other nodes keep alive already (kernel output, V, alpha, the gate).
        ctx.save_for_backward(out, alpha, alpha_ma, gate, v_mean, v)
        ctx.name, ctx.mean = name, mean
        return res

    @staticmethod
    def backward(ctx, grad):
        out, alpha, alpha_ma, gate, v_mean, v = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_dv = v is not None and need[6]
        mean = ctx.mean
        m, denom = v_mean, None
        if v is not None:
            m, denom = mean.value(v)  # a fresh buffer the backward may overwrite once done reading it
        d_out, d_alpha, d_alpha_ma, d_gate, d_m = _kernels(ctx.name).backward(
            grad, out, alpha, alpha_ma, m, gate, need_alpha=need[2], need_alpha_ma=need[3], need_gate=need[4],
            need_m=need[5] or need_dv, m_scratch=denom is not None)
        d_v = mean.transpose(d_m, denom, v) if need_dv else None
        return (None, d_out if need[1] else None, d_alpha, d_alpha_ma, d_gate, d_m if need[5] else None, d_v,
                None)


def _into(op, x: Tensor, y: Tensor, buf: Tensor | None) -> Tensor:
    """op(x, y) written into buf when given (a buffer the caller owns), else into a fresh tensor."""
    return op(x, y) if buf is None else op(x, y, out=buf)


class _eager:
    """The combine as a few eager passes. On CPU a mixed-dtype op (bfloat16 with float32) first materialises a
    float32 copy of its low-precision operand, and a fresh buffer costs more than the pass that fills it, so every
    operand is converted once and the passes run in place on buffers this function owns. Layouts as `epilogue`."""

    @staticmethod
    def _affine_views(out: Tensor, alpha: Tensor, alpha_ma: Tensor, m: Tensor, acc: torch.dtype):
        """a, b = alpha_ma - a as (B, Hm, G, T, 1) and m as (B, Hm, 1, T|1, D): the group broadcast of GQA."""
        B, Hq, T, _ = out.shape
        Hm = m.shape[1]
        a = alpha.to(acc).reshape(B, Hm, Hq // Hm, T, 1)
        b = alpha_ma.to(acc).reshape(1, Hm, Hq // Hm, 1, 1) - a
        return a, b, m.to(acc)[:, :, None]

    @staticmethod
    def _owned(x: Tensor, acc: torch.dtype) -> Tensor:
        """x in acc as a buffer the caller may overwrite (a copy even when x already is in acc)."""
        return x.to(acc, copy=True)

    @staticmethod
    def _combine(out, alpha, alpha_ma, m, acc):
        """y = a * out + b * m in acc, (B, Hq, T, D), a fresh buffer."""
        a, b, m5 = _eager._affine_views(out, alpha, alpha_ma, m, acc)
        B, Hq, T, D = out.shape
        out5 = out.reshape(a.shape[:3] + (T, D))
        y = torch.mul(out5, a) if out.dtype == acc else out5.to(acc).mul_(a)
        return y.addcmul_(b, m5).view(B, Hq, T, D)

    @staticmethod
    def forward(out, alpha, alpha_ma, m, gate):
        acc = float_acc(out.dtype)
        if alpha is None:
            return torch.mul(out, gate).to(out.dtype)
        y = _eager._combine(out, alpha, alpha_ma, m, acc)
        if gate is not None:
            y.mul_(gate)
        return y.to(out.dtype)

    @staticmethod
    def backward(grad, out, alpha, alpha_ma, m, gate, *, need_alpha, need_alpha_ma, need_gate, need_m,
                 m_scratch=False):
        """m_scratch: m is a recomputed buffer this function may overwrite once it no longer reads it."""
        acc = float_acc(out.dtype)
        B, Hq, T, D = out.shape
        d_gate = d_alpha = d_alpha_ma = d_m = None
        # dy = grad * gate in acc. Read-only below: without a gate it may be grad itself.
        gf = grad.to(acc)
        if gate is not None and need_gate:
            y = _eager._combine(out, alpha, alpha_ma, m, acc) if alpha is not None else _eager._owned(out, acc)
            y.mul_(gf)
            d_gate = y.sum_to_size(gate.shape)
            # Elementwise: written in the gate's own layout (a transposed projection), so its producer's backward
            # needs no copy.
            d_gate = (torch.empty_like(gate).copy_(d_gate) if gate.shape == out.shape
                      else d_gate.to(gate.dtype))
            del y
        dy = gf if gate is None else (gf.mul_(gate) if gf is not grad else torch.mul(grad, gate))
        if alpha is None:
            return dy.to(out.dtype), None, None, d_gate, None
        a, b, m5 = _eager._affine_views(out, alpha, alpha_ma, m, acc)
        Hm, G = a.shape[1], a.shape[2]
        dy5, out5 = dy.reshape(B, Hm, G, T, D), out.reshape(B, Hm, G, T, D)
        d_out_acc = torch.mul(dy5, a)
        d_out = d_out_acc.to(out.dtype).view(B, Hq, T, D)
        # Fresh (B, Hm, T, D) acc buffers this function may overwrite: the float32 d out (a copy was made), m.
        # Buffer reuse only in eager mode: a compiled graph plans its own memory (and refuses most `out=`).
        eager = not torch.compiler.is_compiling()
        free = [d_out_acc.view(B, Hq, T, D)] if eager and out.dtype != acc and G == 1 else []  # .to copied it
        m_owned = eager and m_scratch and m.shape[2] == T and m.dtype == acc
        if need_alpha_ma:
            d_alpha_ma = torch.mul(dy5, m5).sum((0, 3, 4)).reshape(Hq).to(alpha_ma.dtype)
        if need_alpha:
            d_alpha = torch.empty((B, Hm, G, T), dtype=acc, device=out.device)
            scratch = free.pop() if free else None
            for g in range(G):
                if g == G - 1 and m_owned:
                    # d alpha = dy . (out - m) = -(dy . (m - out)), computed in m's own buffer.
                    d_alpha[:, :, g] = m.sub_(out5[:, :, g]).mul_(dy5[:, :, g]).sum(-1).neg_()
                    m_owned = False
                    free.append(m)
                else:
                    scratch = _into(torch.sub, out5[:, :, g], m5[:, :, 0], scratch if eager else None).mul_(dy5[:, :, g])
                    d_alpha[:, :, g] = scratch.sum(-1)
            if eager and scratch is not None:
                free.append(scratch)
            d_alpha = d_alpha.view(B, Hq, T).to(alpha.dtype)
        if need_m:
            # d m = sum over the group of (alpha_ma - a) * dy, then over T for a (B, Hm, 1, D) mean.
            if m_owned:
                free.append(m)
            d_m = _into(torch.mul, dy5[:, :, 0], b[:, :, 0], free.pop() if free else None)
            for g in range(1, G):
                d_m.addcmul_(dy5[:, :, g], b[:, :, g])
            d_m = d_m.sum_to_size(m.shape).to(m.dtype)
        return d_out, d_alpha, d_alpha_ma, d_gate, d_m
