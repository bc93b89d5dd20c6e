"""Attention with a sink (GPT-OSS style) and off-by-one softmax: extra exp(s) in the softmax denominator.

Both, and plain softmax, are the one fast path of ops/affine.py (`attention_with_epilogue`) without its affine part.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .affine import attention_with_epilogue
from .masks import MaskSpec


def sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, *, attn_mask: Tensor | None = None,
                   is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                   window: int | None = None, document_ids: Tensor | None = None,
                   backend: str | None = None, mask: MaskSpec | None = None) -> Tensor:
    """p_ij = exp(x_ij) / (sum_k exp(x_ik) + exp(sinks[h])); out_i = sum_j p_ij v_j.

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D); sinks: (Hq,) logits, learnable. Returns (B, Hq, T, D).
    Mask semantics (attn_mask, is_causal, window, document_ids, or mask=) and backend as affine_scaled_attention.
    """
    if not isinstance(sinks, Tensor):
        raise ValueError(f"sinks must be a (Hq,) tensor of sink logits, got {type(sinks).__name__}")
    return attention_with_epilogue(q, k, v, sinks=sinks, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                   enable_gqa=enable_gqa, window=window, document_ids=document_ids, backend=backend,
                                   mask=mask)


def off_by_one_attention(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None,
                         is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                         window: int | None = None, document_ids: Tensor | None = None,
                         backend: str | None = None, mask: MaskSpec | None = None) -> Tensor:
    """Softmax with +1 in the denominator: sink_attention with every sink logit fixed at 0.

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D). Returns (B, Hq, T, D).
    """
    sinks = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device)
    return sink_attention(q, k, v, sinks, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                          enable_gqa=enable_gqa, window=window, document_ids=document_ids, backend=backend,
                                   mask=mask)


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None,
                      is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                      window: int | None = None, document_ids: Tensor | None = None,
                      backend: str | None = None, mask: MaskSpec | None = None) -> Tensor:
    """Standard attention with this library's mask semantics (causal aligned bottom-right, empty rows -> 0).

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D). Returns (B, Hq, T, D).
    """
    return attention_with_epilogue(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                   enable_gqa=enable_gqa, window=window, document_ids=document_ids, backend=backend,
                                   mask=mask)
