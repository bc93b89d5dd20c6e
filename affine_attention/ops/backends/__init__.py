"""Softmax kernel backends behind every op: the dispatcher that asks each registered backend in priority order, and
the one autograd.Function that adds the sink to any backend with a log-sum-exp.

Every module in this folder except base.py is a backend that registers itself (`@register` with a `priority`), so
a new backend is one new file. `backend="name"` on the public ops, or `with use_backend("name"):`, forces one; a
forced backend that cannot serve a call raises a ValueError naming what it lacks, never falling back.
"""
from __future__ import annotations

import importlib
import pkgutil

import torch
from torch import Tensor

from .._once import once_differentiable
from ..._compat import as_dtype, float_acc
from .._forcing import ForcedChoice
from ..call import Score
from ..masks import MaskSpec
from .base import REGISTRY, Backend, Call

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

#: The registered backends, highest priority first (the order of the automatic choice).
BACKENDS: list[Backend] = REGISTRY


def backend_names() -> list[str]:
    return [b.name for b in BACKENDS]


def get_backend(name: str) -> Backend:
    for b in BACKENDS:
        if b.name == name:
            return b
    raise ValueError(f"unknown attention backend {name!r}; choose one of {backend_names()}")


_forced = ForcedChoice(get_backend)


def use_backend(name: str | None):
    """Force every attention op in this block (this thread) onto backend `name` (None: automatic choice)."""
    return _forced.use(name)


def forced_name() -> str | None:
    """The backend `use_backend` forces in this thread, or None."""
    return _forced.current


def _reason(b: Backend, call: Call) -> str | None:
    kind = None if call.score is None else call.score.kind
    if kind is not None and kind not in b.score:
        if kind == "softcap":
            return "no logit soft-capping (softcap)"
        return f"cannot apply a score function ({getattr(call.score.fn, '__name__', type(call.score.fn).__name__)})"
    return b.supports(call)


def explain(call: Call) -> list[tuple[str, str | None]]:
    """The automatic choice step by step: (backend name, why it refuses `call`) for every backend it asks, ending with
    (the one that serves it, None); what `select` does, written out (the `backends` command prints it)."""
    steps = []
    for b in BACKENDS:
        steps.append((b.name, _reason(b, call)))
        if steps[-1][1] is None:
            break
    return steps


def select(call: Call, backend: str | None = None) -> Backend:
    """The backend that serves `call`: the forced one (ValueError if it cannot), else the first that accepts."""
    name = backend if backend is not None else _forced.current
    if name is not None:
        chosen = get_backend(name)
        reason = _reason(chosen, call)
        if reason is not None:
            raise ValueError(f"attention backend {name!r} cannot serve this call: {reason}; drop backend= "
                             f"(automatic choice) or pick another of {backend_names()}")
        return chosen
    reasons = []
    for b in BACKENDS:
        reason = _reason(b, call)
        if reason is None:
            return b
        reasons.append(f"{b.name}: {reason}")
    raise ValueError("no attention backend can serve this call (" + "; ".join(reasons) + ")")


def attention(q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, score: Score, *, sinks: Tensor | None = None,
              backend: str | None = None) -> tuple[Tensor, Tensor | None]:
    """Softmax attention (with the sink's extra exp(sinks[h]) in the denominator when sinks is given) on the
    backend `select` picks.

    q: (B, Hq, T, D) with score.q_scale already folded in (`score.q_scale` is None here); k, v: (B, Hkv, S, D);
    sinks: (Hq,) or None; score: scale and score function (only backends declaring its kind serve it). Returns
    (out (B, Hq, T, D) in q.dtype, lse (B, Hq, T) float32 of the plain softmax, or None when the chosen backend has
    none).
    """
    if score.q_scale is not None:
        raise ValueError("backends.attention takes q with score.q_scale folded in (ops.attention does it)")
    chosen = select(Call.of(q, k, mask, needs_lse=sinks is not None, score=score), backend)
    q, k, v = fit_layout(chosen, q), fit_layout(chosen, k), fit_layout(chosen, v)
    if chosen.differentiable_lse:  # the sink is plain autograd on a log-sum-exp that has a gradient of its own
        out, lse = chosen.attention(q, k, v, mask, score, with_lse=sinks is not None)
        return with_sink(out, lse, sinks)[0], lse
    if not chosen.has_lse:
        return chosen.attention(q, k, v, mask, score), None
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
        out, lse = chosen.forward(q, k, v, mask, score)  # nothing to differentiate (decoding): no node
        return with_sink(out, lse, sinks)[0], lse
    return KernelAttention.apply(chosen, q, k, v, sinks, mask, score)


def fit_layout(b: Backend, t: Tensor) -> Tensor:
    """t: (B, H, T|S, D) as backend b can read it: t itself when b accepts its layout (no copy), else one contiguous
    copy (differentiable: autograd maps the gradient back onto the original view, summing over expanded dims)."""
    return t if b.accepts_layout(t) else t.contiguous()


def with_sink(out: Tensor, lse: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """out: (B, Hq, T, D), lse: (B, Hq, T), sinks: (Hq,) or None -> (out * g, g) with g = sigmoid(lse - s):
    (B, Hq, T) in float32 (float64 for float64); (out, None) without sinks. An empty row (lse = -inf) gets 0."""
    if sinks is None:
        return out, None
    acc = float_acc(out.dtype)
    gate = torch.sigmoid(_sink_gap(lse, sinks, acc))
    return as_dtype(as_dtype(out, acc) * gate[..., None], out.dtype), gate


def _sink_gap(lse: Tensor, sinks: Tensor, acc: torch.dtype) -> Tensor:
    """lse (B, Hq, T) - sinks (Hq,) in acc: the sink gate is sigmoid of it. A row that sees no key (lse = -inf) under
    a sink of -inf (no sink) has no mass anywhere: -inf, so its gate is 0, where -inf - -inf would give nan."""
    lse, s = as_dtype(lse, acc), as_dtype(sinks, acc)[None, :, None]
    gap = lse - s
    return torch.where(torch.isneginf(lse) & torch.isneginf(s), torch.full_like(gap, float("-inf")), gap)


class KernelAttention(torch.autograd.Function):
    """Softmax attention through a backend's raw pair, optionally with a sink: out' = out * g, g = sigmoid(lse - s).

    Every aten kernel returns its lse without gradient, so the sink cannot be built on a raw lse. Backward feeds
    the backend (g * dO, out', lse) instead: its row term then is g^2 dO.out = dO.out', which is exactly the
    softmax-with-sink gradient; d s = -sum_i g_i (1 - g_i) dO_i.out_i (computed in the non-cancelling form).
    """

    @staticmethod
    def forward(ctx, backend: Backend, q, k, v, sinks, mask: MaskSpec, score: Score):
        out, lse = backend.forward(q, k, v, mask, score)
        out, gate = with_sink(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, gate, sinks)
        ctx.backend, ctx.mask, ctx.score = backend, mask, score
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable("the attention kernel")  # a second derivative raises, naming what to use instead
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
                one_minus = torch.sigmoid(-_sink_gap(lse, sinks, acc))
                dsinks = -(one_minus * delta).sum((0, 2)).to(sinks.dtype)
        dq, dk, dv = ctx.backend.backward(grad, q, k, v, out, lse, ctx.mask, ctx.score)
        return None, dq, dk, dv, dsinks, None, None


__all__ = ["BACKENDS", "Backend", "Call", "KernelAttention", "attention", "backend_names", "explain", "fit_layout",
           "forced_name", "get_backend", "select", "use_backend", "with_sink"]
