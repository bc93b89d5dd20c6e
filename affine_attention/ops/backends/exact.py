"""Exact eager attention for any mask, device and dtype: chunked over queries in both directions.

The forward keeps only (out, lse); the backward recomputes each chunk's weights from the lse, so memory stays at
CHUNK x S weights per head at a time in both passes, never every chunk's at once.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._compat import float_acc
from ..call import Score, Softcap
from ..masks import MaskSpec
from .base import Backend, Call, register

# Queries per chunk: bounds memory at CHUNK x S weights per head.
CHUNK = 256


def _expand(x: Tensor, Hq: int) -> Tensor:
    """(B, Hkv, S, D) -> (B, Hq, S, D), each KV head repeated over its query group."""
    return x if x.shape[1] == Hq else x.repeat_interleave(Hq // x.shape[1], dim=1)


def _logits(q_c: Tensor, k: Tensor, score: Score, slope: bool) -> tuple[Tensor, Tensor | None]:
    """(logits (B, Hq, C, S), d logits / d (q.k scale) or None): score.fn of q.k * scale; with slope, the
    derivative of fn that the backward multiplies in (Softcap's 1 - tanh^2 in closed form; any other elementwise
    function's by autograd at these logits)."""
    x = (q_c @ k.transpose(-1, -2)) * score.scale
    fn = score.fn
    if fn is None:
        return x, None
    if not slope:
        return fn(x), None
    if isinstance(fn, Softcap):
        return fn(x), fn.derivative(x)
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        y = fn(xg)
        (d,) = torch.autograd.grad(y.sum(), xg)  # elementwise: the gradient of the sum is the slope
    return y.detach(), d


def _weights(logits: Tensor, vis: Tensor, lse: Tensor | None):
    """Softmax weights of one query chunk. logits: (B, Hq, C, S) acc, vis: bool broadcastable to (B, Hq, C, S).
    Returns (p (B, Hq, C, S), lse (B, Hq, C)); lse = -inf and p = 0 for a row that sees nothing."""
    logits = logits.masked_fill(~vis, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)
    finite = torch.isfinite(lse)
    shift = torch.where(finite, lse, torch.zeros_like(lse))[..., None]
    p = torch.exp(logits - shift)  # exp(-inf) = 0 on hidden keys, so empty rows are all 0
    return p, lse


@register
class ExactBackend(Backend):
    name = "exact"
    priority = 10  # last: any mask, device and dtype
    score = frozenset({"softcap", "score_fn"})  # it materialises the logits, so any elementwise function

    def supports(self, call: Call) -> str | None:
        return None  # any mask, device and dtype

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, score: Score) -> tuple[Tensor, Tensor]:
        acc = float_acc(q.dtype)
        B, Hq, T, D = q.shape
        kf, vf = _expand(k, Hq).to(acc), _expand(v, Hq).to(acc)
        out = q.new_zeros(B, Hq, T, D, dtype=q.dtype)
        lse = torch.full((B, Hq, T), float("-inf"), dtype=acc, device=q.device)
        for start in range(0, T, CHUNK):
            stop = min(T, start + CHUNK)
            vis = mask.chunk_bool(start, stop, q.device)
            p, lse_c = _weights(_logits(q[:, :, start:stop].to(acc), kf, score, False)[0], vis, None)
            out[:, :, start:stop] = (p @ vf).to(q.dtype)
            lse[:, :, start:stop] = lse_c
        return out, lse

    def backward(self, dout, q, k, v, out, lse, mask, score):
        scale = score.scale
        acc = float_acc(q.dtype)
        B, Hq, T, D = q.shape
        Hkv = k.shape[1]
        kf, vf = _expand(k, Hq).to(acc), _expand(v, Hq).to(acc)
        dof = dout.to(acc)
        delta = (dof * out.to(acc)).sum(-1, keepdim=True)  # (B, Hq, T, 1): the row term D_i
        dq = torch.empty(B, Hq, T, D, dtype=acc, device=q.device)
        dk = torch.zeros_like(kf)
        dv = torch.zeros_like(vf)
        for start in range(0, T, CHUNK):
            stop = min(T, start + CHUNK)
            vis = mask.chunk_bool(start, stop, q.device)
            q_c = q[:, :, start:stop].to(acc)
            logits, dcap = _logits(q_c, kf, score, True)
            p, _ = _weights(logits, vis, lse[:, :, start:stop])
            do_c = dof[:, :, start:stop]
            dv += p.transpose(-1, -2) @ do_c
            ds = p * (do_c @ vf.transpose(-1, -2) - delta[:, :, start:stop])
            if dcap is not None:
                ds = ds * dcap
            dq[:, :, start:stop] = (ds @ kf) * scale
            dk += (ds.transpose(-1, -2) @ q_c) * scale
        if Hkv != Hq:
            G = Hq // Hkv
            dk = dk.view(B, Hkv, G, *dk.shape[2:]).sum(2)
            dv = dv.view(B, Hkv, G, *dv.shape[2:]).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
