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

from .._compat import as_dtype, float_acc
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


def forced_name() -> str | None:
    """The implementation `use_epilogue` forces in this thread, or None."""
    return _forced.current


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


def gate4(gate: Tensor | float | None, out: Tensor) -> Tensor | None:
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
    g = gate4(gate, out)
    if alpha is None:
        if alpha_ma is not None or v_mean is not None or v is not None:
            raise ValueError("alpha_ma, v_mean and v belong to the affine part: pass alpha with them, or none")
    else:
        if alpha_ma is None:
            raise ValueError("alpha needs alpha_ma: (Hq,), the running mean of alpha")
        if (v_mean is None) == (v is None) or (v is not None and not isinstance(mean, ValueMean)):
            raise ValueError("the affine epilogue needs the mean of visible V: pass exactly one of v_mean "
                             "(B, Hkv, T|1, D) or v (B, Hkv, S, D) together with mean=ValueMean(...)")
        if v is not None and not mean.has_transpose:
            raise ValueError("v with mean= recomputes the mean in backward only for prefix-sum masks (none, causal "
                             "with T <= S, key padding); for this mask pass v_mean=mean.of(v) (autograd keeps it)")
        if v_mean is not None:
            _check_affine(out, alpha, alpha_ma, tuple(v_mean.shape))
    return run_checked(select_impl(out.device, impl), out, alpha, alpha_ma, g, v_mean, v, mean)


def run_checked(name: str, out: Tensor, alpha, alpha_ma, gate, v_mean, v, mean) -> Tensor:
    """`epilogue` after its checks, with gate already rank 4 (`gate4`) and the implementation chosen: for callers
    that validated every argument themselves (the attention ops, once per call)."""
    g = gate
    if alpha is None and g is None:
        return out
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad
                                              for t in (out, alpha, alpha_ma, g, v_mean, v)):
        # Nothing to differentiate (decoding): the forward alone, without an autograd node (a few µs per layer).
        return _forward(name, out, alpha, alpha_ma, g, v_mean, v, mean)
    return _Epilogue.apply(name, out, alpha, alpha_ma, g, v_mean, v, mean)


def _kernels(name: str):
    if name == "triton":
        from . import epilogue_triton
        return epilogue_triton
    return _eager


def _forward(name, out, alpha, alpha_ma, gate, v_mean, v, mean) -> Tensor:
    """The combine through implementation `name`, the mean of V summed from v when it is not given."""
    if v is None:
        return _kernels(name).forward(out, alpha, alpha_ma, v_mean, gate)
    total, inv = mean.sum(v)
    if alpha is not None:
        _check_affine(out, alpha, alpha_ma, tuple(total.shape))
    return _kernels(name).forward(out, alpha, alpha_ma, total, gate, inv=inv, m_owned=True)


class _Epilogue(torch.autograd.Function):
    """Forward through one implementation; backward recomputes the sums of V from v (when given so), calls the same
    one, and maps their gradient to d v through the mean's hand-written transpose. While compiling, forward returns
    no tensor made by an in-place or out= op, nor a view of one: dynamo 2.11 silently gives such a Function zero
    gradients for every input (2.13 does not)."""

    @staticmethod
    def forward(ctx, name, out, alpha, alpha_ma, gate, v_mean, v, mean):
        res = _forward(name, out, alpha, alpha_ma, gate, v_mean, v, mean)
        # Every saved tensor is an input other nodes keep alive already (kernel output, V, alpha, the gate).
        ctx.save_for_backward(out, alpha, alpha_ma, gate, v_mean, v)
        ctx.name, ctx.mean = name, mean
        return res

    @staticmethod
    def backward(ctx, grad):
        out, alpha, alpha_ma, gate, v_mean, v = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_dv = v is not None and need[6]
        m, inv = v_mean, None
        if v is not None:
            m, inv = ctx.mean.sum(v)  # a fresh buffer the backward may overwrite once done reading it
        d_out, d_alpha, d_alpha_ma, d_gate, d_m = _kernels(ctx.name).backward(
            grad, out, alpha, alpha_ma, m, gate, need_alpha=need[2], need_alpha_ma=need[3], need_gate=need[4],
            need_m=need[5] or need_dv, m_scratch=v is not None, inv=inv)
        d_v = ctx.mean.transpose(d_m, v) if need_dv else None
        return (None, d_out if need[1] else None, d_alpha, d_alpha_ma, d_gate, d_m if need[5] else None, d_v,
                None)


class _eager:
    """The combine as a few eager passes. On CPU a mixed-dtype op (bfloat16 with float32) first materialises a
    float32 copy of its low-precision operand, and a fresh buffer costs more than the pass that fills it, so every
    operand is converted at most once and the passes run in place on buffers this function owns. m is either the
    mean of V or, with inv (the mean's 1 / N, (B|1, 1, T|1, 1)), the undivided sums: inv goes into the per-row
    weight of m, so the mean is never formed. Layouts as `epilogue`."""

    @staticmethod
    def _coefficients(out: Tensor, alpha: Tensor, alpha_ma: Tensor, m: Tensor, inv: Tensor | None, acc):
        """a: (B, Hm, G, T, 1); b = (alpha_ma - a) * inv, the weight of m; m as (B, Hm, 1, T|1, D) in acc: the
        group broadcast of GQA, without copies."""
        B, Hq, T, _ = out.shape
        Hm = m.shape[1]
        a = alpha.reshape(B, Hm, Hq // Hm, T, 1)
        a = as_dtype(a, acc)
        b = as_dtype(alpha_ma, acc).reshape(1, Hm, Hq // Hm, 1, 1) - a  # a fresh buffer: scaled in place
        if inv is not None:
            b.mul_(inv.unsqueeze(2))
        return a, b, as_dtype(m, acc).unsqueeze(2)

    @staticmethod
    def _combine(out: Tensor, a: Tensor, b: Tensor, m5: Tensor, acc, m_owned: bool = False) -> Tensor:
        """y = a * out + b * m in acc as (B, Hm, G, T, D); in m's own buffer when it is owned and has y's shape."""
        B, Hm, G, T, _ = a.shape
        out5 = out.reshape(B, Hm, G, T, out.shape[-1])
        if torch.compiler.is_compiling():  # out of place (see _Epilogue); the graph plans its own buffers anyway
            return torch.addcmul(torch.mul(as_dtype(out5, acc), a), b, m5)
        if m_owned and m5.shape == out5.shape and m5.is_contiguous():
            return m5.mul_(b).addcmul_(out5, a)
        y = torch.mul(out5, a) if out.dtype == acc else out5.to(acc).mul_(a)
        return y.addcmul_(b, m5)

    @staticmethod
    def forward(out, alpha, alpha_ma, m, gate, inv=None, m_owned=False):
        """m_owned: m is this call's own buffer (recomputed sums), which the combine may overwrite."""
        if alpha is None:
            return as_dtype(torch.mul(out, gate), out.dtype)
        acc = float_acc(out.dtype)
        # a * out + (alpha_ma - a) * m, not a * (out - m) + alpha_ma * m: where alpha == alpha_ma (a retrofitted
        # model) m's weight is exactly 0 and the output is out itself, bit for bit.
        a, b, m5 = _eager._coefficients(out, alpha, alpha_ma, m, inv, acc)
        # Sizes as ints: view(torch.Size) parses its argument slowly (1.9 µs against 0.8 µs, per decode step).
        B, Hq, T, D = out.shape
        y = _eager._combine(out, a, b, m5, acc, m_owned).view(B, Hq, T, D)
        if gate is not None:
            # In place saves a (B, Hq, T, D) buffer in eager; while compiling it would zero every gradient (_Epilogue).
            y = torch.mul(y, gate) if torch.compiler.is_compiling() else y.mul_(gate)
        return as_dtype(y, out.dtype)

    @staticmethod
    def backward(grad, out, alpha, alpha_ma, m, gate, *, need_alpha, need_alpha_ma, need_gate, need_m,
                 m_scratch=False, inv=None):
        """d m is the gradient of m as given (with inv: of the undivided sums). m_scratch: m is a recomputed
        buffer this function may overwrite once it no longer reads it."""
        acc = float_acc(out.dtype)
        B, Hq, T, D = out.shape
        d_gate = d_alpha = d_alpha_ma = d_m = None
        if alpha is not None:
            a, b, m5 = _eager._coefficients(out, alpha, alpha_ma, m, inv, acc)
        # dy = grad * gate in acc. Read-only below: without a gate it may be grad itself.
        gf = grad.to(acc)
        if gate is not None and need_gate:
            y = _eager._combine(out, a, b, m5, acc).view(B, Hq, T, D) if alpha is not None else out.to(acc, copy=True)
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
        Hm, G = a.shape[1], a.shape[2]
        dy5, out5 = dy.reshape(B, Hm, G, T, D), out.reshape(B, Hm, G, T, D)
        # Buffer reuse only in eager mode: a compiled graph plans its own memory (and refuses most `out=`).
        eager = not torch.compiler.is_compiling()
        if eager and out.dtype != acc:
            d_out = torch.empty((B, Hq, T, D), dtype=out.dtype, device=out.device)
            torch.mul(dy5, a, out=d_out.view(B, Hm, G, T, D))  # rounded once, no float32 copy
        else:
            d_out = torch.mul(dy5, a).to(out.dtype).view(B, Hq, T, D)
        if need_alpha_ma:
            rows = torch.linalg.vecdot(dy5, m5)  # (B, Hm, G, T)
            if inv is not None:
                rows = rows * inv.unsqueeze(2)[..., 0]  # inv as (B|1, 1, 1, T|1): the weight of m's rows
            d_alpha_ma = rows.sum((0, 3)).reshape(Hq).to(alpha_ma.dtype)
        if need_alpha:
            # d alpha = dy . (out - m)
            if eager and m_scratch and inv is not None and G == 1 and m5.shape == out5.shape and m5.is_contiguous():
                # out - m formed in m's own buffer in one pass, then the product: no temporary (B, Hq, T, D).
                da = torch.addcmul(out5, m5, inv.unsqueeze(2), value=-1.0, out=m5).mul_(dy5).sum(-1)
            else:
                # Per group of query heads, out - m in one (B, Hm, T, D) scratch buffer, then the product: no
                # (B, Hq, T, D) float32 temporary (a row dot product would build one).
                scratch = torch.empty((B, Hm, T, D), dtype=acc, device=out.device)
                da = torch.empty((B, Hm, G, T), dtype=acc, device=out.device)
                for g in range(G):
                    scratch.copy_(out5[:, :, g])
                    if inv is None:
                        scratch.sub_(m5[:, :, 0])
                    else:
                        scratch.addcmul_(m5[:, :, 0], inv, value=-1.0)
                    da[:, :, g] = scratch.mul_(dy5[:, :, g]).sum(-1)
            d_alpha = da.view(B, Hq, T).to(alpha.dtype)
        if need_m:
            # d m = sum over the group of b * dy (then over T for a (B, Hm, 1, D) m); m is read no more.
            buf = m if eager and m_scratch and m.shape == (B, Hm, T, D) and m.is_contiguous() else None
            d_m = torch.mul(dy5[:, :, 0], b[:, :, 0]) if buf is None else torch.mul(dy5[:, :, 0], b[:, :, 0], out=buf)
            for g in range(1, G):
                d_m.addcmul_(dy5[:, :, g], b[:, :, g])
            d_m = d_m.sum_to_size(m.shape).to(m.dtype)
        return d_out, d_alpha, d_alpha_ma, d_gate, d_m
