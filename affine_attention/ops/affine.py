"""Affine-Scaled Attention, fast path: out_i = alpha_i * Attn_i + (alpha_ma - alpha_i) * mean of visible V.

The identity holds because beta_i = (alpha_ma - alpha_i) / N_i is added to each of the N_i visible keys, so
any softmax kernel plus a masked mean of V (prefix sums under a causal mask) gives the exact result.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._compat import float_acc
from ._validate import check_bias_norm, check_per_head, check_per_query, check_qkv, check_scale, check_v_mean
from .backends import attention as kernel_attention
from .isolate import isolate_nonfinite, poison_seen
from .masks import parse_mask, visible_sum_and_count


def affine_scaled_attention(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, alpha_ma: Tensor, *,
                            attn_mask: Tensor | None = None, is_causal: bool = False, scale: float | None = None,
                            bias_norm: str = "visible", enable_gqa: bool = False, window: int | None = None,
                            document_ids: Tensor | None = None, backend: str | None = None,
                            v_mean: Tensor | None = None) -> Tensor:
    """Affine-Scaled Attention: a_ij = alpha_i * softmax_j(q_i.k_j * scale) + (alpha_ma - alpha_i) / N_i.

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D); alpha: (B, Hq, T); alpha_ma: (Hq,). Returns (B, Hq, T, D).
    attn_mask: bool broadcastable to (B, Hq, T, S), True = may attend. is_causal aligns the last query with the
    last key (bottom-right), so T < S continues a cache. N_i is the number of keys query i may see
    (bias_norm="visible"); bias_norm="full" uses N = S for every query and exists only as an ablation.
    window: each query sees at most its last `window` keys (needs is_causal). document_ids: (B, S) int,
    non-decreasing: a query sees only keys of its own document. backend: force a kernel backend by name.
    v_mean: optional precomputed mean of the visible values, (B, Hkv, T, D) float32, e.g. from a decoding
    cache's running sum; it replaces the masked mean and must follow the same bias_norm.
    A query that sees no key returns zeros.
    """
    B, Hq, Hkv, T, S, D = check_qkv(q, k, v, enable_gqa)
    check_per_query("alpha", alpha, B, Hq, T, q.device)
    check_per_head("alpha_ma", alpha_ma, Hq, q.device)
    check_bias_norm(bias_norm)
    scale = check_scale(scale, D)
    mask = parse_mask(attn_mask, is_causal, B, Hq, T, S, q.device, window=window, document_ids=document_ids)

    k, v, seen = isolate_nonfinite(k, v, mask, Hq)
    attn, _ = kernel_attention(q, k, v, mask, scale, backend=backend)
    acc = float_acc(q.dtype)
    if v_mean is None:
        total, count = visible_sum_and_count(v, mask, Hq)
        denom = count if bias_norm == "visible" else count.new_full((), float(S))
        v_mean = total / denom.clamp(min=1)
    else:
        check_v_mean(v_mean, B, Hq, Hkv, T, D, q.device)
    a = alpha.to(acc)[..., None]  # (B, Hq, T, 1)
    b = alpha_ma.to(acc)[None, :, None, None] - a
    G = Hq // v_mean.shape[1]
    # Broadcast the per-KV-head mean over its query group without copying it; one fused multiply-add after.
    bias_term = (b.view(B, Hq // G, G, T, 1) * v_mean.to(acc)[:, :, None]).view(B, Hq, T, D)
    return poison_seen(torch.addcmul(bias_term, a, attn.to(acc)).to(q.dtype), seen)
