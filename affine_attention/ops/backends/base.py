"""The contract every softmax kernel backend follows, and the one autograd.Function that adds the sink to any of them.

A backend computes plain softmax attention for a MaskSpec and returns (out, lse). Backends with a log-sum-exp
implement `forward`/`backward` as raw (non-autograd) functions; `KernelAttention` wraps them once, so the sink
form out * sigmoid(lse - s) gets its exact gradient on every such backend (never through a raw lse, which aten
kernels return without gradient). Backends without an lse (SDPA) are differentiable by themselves and serve only
calls that need no lse.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..._compat import as_dtype, float_acc
from ..masks import MaskSpec


class Call(NamedTuple):
    """What a backend is asked to do; `Backend.supports` reads only this (shapes, dtype, device, mask kinds).

    q: (B, Hq, T, D), k/v: (B, Hkv, S, D). needs_lse: the caller wants the log-sum-exp (sinks) or, equivalently,
    the raw forward/backward pair. A NamedTuple: built once per op call, and a decoding step is tens of µs.
    """

    device_type: str
    dtype: torch.dtype
    B: int
    Hq: int
    Hkv: int
    T: int
    S: int
    D: int
    mask: MaskSpec
    needs_lse: bool
    requires_grad: bool

    @staticmethod
    def of(q: Tensor, k: Tensor, mask: MaskSpec, needs_lse: bool) -> "Call":
        B, Hq, T, D = q.shape
        return Call(q.device.type, q.dtype, B, Hq, k.shape[1], T, k.shape[2], D, mask, needs_lse,
                    torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))


class Backend:
    """One softmax kernel. Subclasses set `name`, implement `supports`, and either `attention` (differentiable,
    no lse) or the raw pair `forward`/`backward` (has_lse = True).

    Layouts: q (B, Hq, T, D); k, v (B, Hkv, S, D); out (B, Hq, T, D) in q.dtype; lse (B, Hq, T) float32 (float64
    for float64 inputs), -inf for a query that sees no key (whose out is 0). GQA is native (Hq a multiple of Hkv).
    """

    name: str = ""
    has_lse: bool = True

    def supports(self, call: Call) -> str | None:
        """None if this backend computes `call` exactly; otherwise a short reason naming what it lacks."""
        raise NotImplementedError

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, scale: float) -> Tensor:
        """Differentiable softmax attention (backends without an lse)."""
        raise NotImplementedError(f"backend {self.name!r} has no differentiable attention()")

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, scale: float) -> tuple[Tensor, Tensor]:
        """Raw forward (no autograd): (out, lse)."""
        raise NotImplementedError(f"backend {self.name!r} has no raw forward()")

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: MaskSpec,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """Raw backward of softmax attention: (dq, dk, dv) given dout and the forward's out and lse.

        Uses the row term D_i = sum_d dout_id * out_id; the sink trick relies on exactly that (see KernelAttention).
        """
        raise NotImplementedError(f"backend {self.name!r} has no raw backward()")


def with_sink(out: Tensor, lse: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """out: (B, Hq, T, D), lse: (B, Hq, T), sinks: (Hq,) or None -> (out * g, g) with g = sigmoid(lse - s):
    (B, Hq, T) in float32 (float64 for float64); (out, None) without sinks. An empty row (lse = -inf) gets 0."""
    if sinks is None:
        return out, None
    acc = float_acc(out.dtype)
    gate = torch.sigmoid(as_dtype(lse, acc) - as_dtype(sinks, acc)[None, :, None])
    return as_dtype(as_dtype(out, acc) * gate[..., None], out.dtype), gate


class KernelAttention(torch.autograd.Function):
    """Softmax attention through a backend's raw pair, optionally with a sink: out' = out * g, g = sigmoid(lse - s).

    Backward: feed the backend (g * dO, out', lse). Its row term then is g^2 dO.out = dO.out', which is exactly the
    softmax-with-sink gradient; d s = -sum_i g_i (1 - g_i) dO_i.out_i (computed in the non-cancelling form).
    """

    @staticmethod
    def forward(ctx, backend: Backend, q, k, v, sinks, mask: MaskSpec, scale: float):
        out, lse = backend.forward(q, k, v, mask, scale)
        out, gate = with_sink(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, gate, sinks)
        ctx.backend, ctx.mask, ctx.scale = backend, mask, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, gate, sinks = ctx.saved_tensors
        dsinks = None
        grad = dout.contiguous()
        if gate is not None:
            acc = gate.dtype
            grad = (dout.to(acc) * gate[..., None]).to(dout.dtype).contiguous()
            if ctx.needs_input_grad[4]:
                # dO . out' = g * (dO . out); d gate / d s = -g (1 - g), and 1 - g = sigmoid(s - lse) does not cancel.
                delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, Hq, T) = g * dO.out
                one_minus = torch.sigmoid(sinks.to(acc)[None, :, None] - lse.to(acc))
                dsinks = -(one_minus * delta).sum((0, 2)).to(sinks.dtype)
        dq, dk, dv = ctx.backend.backward(grad, q, k, v, out, lse, ctx.mask, ctx.scale)
        return None, dq, dk, dv, dsinks, None, None
