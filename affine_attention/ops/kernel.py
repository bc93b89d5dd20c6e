"""Softmax attention kernels behind every op: fused SDPA/flash where the mask allows, an exact chunked path otherwise.

Every function takes q: (B, Hq, T, D), k, v: (B, Hkv, S, D) and a MaskSpec, and returns (B, Hq, T, D) in q's
dtype. A query that sees no key gets a zero output, never NaN. With `sinks: (Hq,)` the softmax denominator gains
exp(sinks[h]) (a sink key with value 0), which is the kernel output times sigmoid(lse - s).
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from .._compat import float_acc
from .masks import MaskSpec

# Queries per chunk on the exact path: bounds its memory at CHUNK x S weights per head.
CHUNK = 256


def _cpu_flash_ops():
    return (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)


class _CpuFlashAttention(torch.autograd.Function):
    """PyTorch's CPU flash kernel, which also returns the log-sum-exp, with an optional sink.

    The sink's backward is the flash backward fed with (g * dO, the sink output, lse): the kernel's row term
    D_i = sum(dO' * out) then equals g^2 dO.O, which is exactly the softmax-with-sink gradient, so no T x S
    tensor is ever formed in either direction.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, is_causal, scale):
        fwd, _ = _cpu_flash_ops()
        out, lse = fwd(q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale)
        gate = None
        if sinks is not None:
            # lse of an empty row is -inf, so gate = 0 and the output stays 0.
            acc = float_acc(q.dtype)
            gate = torch.sigmoid(lse.to(acc) - sinks.to(acc)[None, :, None])
            out = (out.to(acc) * gate[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, bias, out, lse, gate, sinks)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, bias, out, lse, gate, sinks = ctx.saved_tensors
        _, bwd = _cpu_flash_ops()
        dsinks = None
        grad = dout.contiguous()
        if gate is not None:
            acc = gate.dtype
            grad = (dout.to(acc) * gate[..., None]).to(dout.dtype).contiguous()
            if ctx.needs_input_grad[4]:
                delta = (dout.to(acc) * out.to(acc)).sum(-1)  # dO . out, (B, Hq, T)
                dsinks = -((1.0 - gate) * delta).sum((0, 2)).to(sinks.dtype)
        dq, dk, dv = bwd(grad, q, k, v, out, lse, 0.0, ctx.is_causal, attn_mask=bias, scale=ctx.scale)
        return dq, dk, dv, None, dsinks, None, None


def _key_bias(keys: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """(B|1, 1, 1, S) bool -> additive float bias the CPU flash kernel takes (it broadcasts, never T x S)."""
    if keys is None:
        return None
    return torch.zeros(keys.shape, dtype=dtype, device=keys.device).masked_fill(~keys, float("-inf"))


def softmax_kernel(q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, scale: float,
                   sinks: Tensor | None = None) -> Tensor:
    """Softmax (optionally with sink) attention, choosing the fastest exact path for the mask.

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D); sinks: (Hq,) or None. Returns (B, Hq, T, D) in q.dtype.
    """
    Hq, Hkv = q.shape[1], k.shape[1]
    no_mask = mask.keys is None and mask.dense is None
    plain_causal = mask.causal_square or not mask.causal or mask.causal_is_trivial
    causal_flag = mask.causal and not mask.causal_is_trivial
    if sinks is None and no_mask and plain_causal and mask.S > 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal_flag, scale=scale,
                                              enable_gqa=Hq != Hkv)
    if q.device.type == "cpu" and mask.dense is None and mask.S > 0:
        bias = _key_bias(mask.keys, q.dtype)
        causal = causal_flag
        if causal and not mask.causal_square:
            # Queries after a cache (1 < T < S): the kernel aligns top-left, so the bottom-right causal
            # rule goes in as a (T, S) bias. Decoding (T == 1) and training (T == S) never come here.
            cb = torch.zeros(mask.T, mask.S, dtype=q.dtype, device=q.device)
            cb = cb.masked_fill(~mask.causal_bool(q.device), float("-inf"))[None, None]
            bias = cb if bias is None else bias + cb
            causal = False
        return _CpuFlashAttention.apply(q, k, v, bias, sinks, causal, scale)
    return softmax_exact(q, k, v, mask, scale, sinks)


def softmax_exact(q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, scale: float,
                  sinks: Tensor | None = None) -> Tensor:
    """Exact eager attention for any mask and device, chunked over queries (CHUNK x S weights per head at a time).

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D). Differentiable through autograd.
    """
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    if Hq != Hkv:
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    acc = float_acc(q.dtype)
    full = mask.dense_bool(q.device)  # (B|1, H|1, T, S)
    outs = []
    for start in range(0, T, CHUNK):
        stop = min(T, start + CHUNK)
        vis = full[:, :, start:stop]
        logits = (q[:, :, start:stop].to(acc) @ k.to(acc).transpose(-1, -2)) * scale
        logits = logits.masked_fill(~vis, float("-inf"))
        if sinks is not None:
            sink_col = sinks.to(acc)[None, :, None, None].expand(B, Hq, stop - start, 1)
            logits = torch.cat([logits, sink_col], dim=-1)
        m = logits.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
        e = torch.exp(logits - m)
        z = e.sum(-1, keepdim=True)
        p = e / torch.where(z > 0, z, torch.ones_like(z))
        if sinks is not None:
            p = p[..., :-1]
        outs.append(p @ v.to(acc))
    return torch.cat(outs, dim=2).to(q.dtype)
