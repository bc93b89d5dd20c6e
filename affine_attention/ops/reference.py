"""Readable eager reference of every attention op: materialises the weights and returns them (tests, analysis).

Deliberately independent of the fast paths (its own mask construction, no kernels), so that agreement between
the two is evidence. Returns weights over keys: (B, Hq, T, S); for the sink, the sink's mass is 1 - their sum.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._validate import check_bias_norm, check_per_head, check_per_query, check_qkv, check_scale, check_softcap
from .call import Score
from .masks import MaskSpec


def visible_of(mask: MaskSpec, device) -> Tensor:
    """(1|B, 1|Hq, T, S) bool: what a parsed mask lets each query see, read from its fields by this module's own
    rules (`visible_mask`), not by the fast path's (MaskSpec.chunk_bool), so agreement between them is evidence."""
    extra = mask.keys if mask.keys is not None else mask.dense
    if mask.keys is not None and mask.dense is not None:
        extra = mask.keys & mask.dense
    return visible_mask(extra, mask.causal, mask.T, mask.S, device, window=mask.window, document_ids=mask.documents)


def visible_mask(attn_mask: Tensor | None, is_causal: bool, T: int, S: int, device, *, window: int | None = None,
                 document_ids: Tensor | None = None) -> Tensor:
    """(1|B, 1|Hq, T, S) bool: causal rule j <= i + (S - T) (bottom-right), the sliding window (key j visible to
    query i iff i + S - T - j < window), documents (document_ids: (B, S); query i has the id of position
    i + S - T), combined with attn_mask."""
    vis = torch.ones(T, S, dtype=torch.bool, device=device)
    if is_causal:
        vis = torch.tril(vis, diagonal=S - T)
    if window is not None:
        vis = vis & ~torch.tril(torch.ones_like(vis), diagonal=S - T - window)
    vis = vis[None, None]
    if document_ids is not None:
        docs = document_ids.to(device)
        vis = vis & (docs[:, None, S - T:, None] == docs[:, None, None, :])
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise ValueError(f"attn_mask must be a boolean tensor (True = may attend), got dtype {attn_mask.dtype}")
        vis = vis & attn_mask
    return vis


def attention_logits(q: Tensor, k: Tensor, *, scale: float | None = None, enable_gqa: bool = False,
                     softcap: float | None = None, score: Score | None = None) -> Tensor:
    """q.k^T * scale: q (B, Hq, T, D), k (B, Hkv, S, D) -> (B, Hq, T, S); GQA repeats each KV head. softcap = c
    caps them to c * tanh(x / c), as Gemma 2 does before the softmax. score (instead of scale and softcap): the
    call's Score, its per-query scale and score function included."""
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq != Hkv:
        k = k.repeat_interleave(Hq // Hkv, dim=1)
    if score is not None:
        if scale is not None or softcap is not None:
            raise ValueError("pass the score once: score= or scale / softcap, not both")
        return score.logits(q @ k.transpose(-1, -2))
    x = (q @ k.transpose(-1, -2)) * check_scale(scale, q.shape[-1])
    softcap = check_softcap(softcap)
    return x if softcap is None else softcap * torch.tanh(x / softcap)


def _visible(mask: MaskSpec | None, attn_mask, is_causal, T, S, device, window, document_ids) -> Tensor:
    """The visibility of a reference call: from `mask` (a parsed MaskSpec) or from the keywords, not both."""
    if mask is None:
        return visible_mask(attn_mask, is_causal, T, S, device, window=window, document_ids=document_ids)
    if attn_mask is not None or is_causal or window is not None or document_ids is not None:
        raise ValueError("pass the mask once: mask= (a MaskSpec) or the keywords, not both")
    if (mask.T, mask.S) != (T, S):
        raise ValueError(f"mask was parsed for T = {mask.T}, S = {mask.S}, but q and k have T = {T}, S = {S}")
    return visible_of(mask, device)


def _expand_v(v: Tensor, Hq: int) -> Tensor:
    return v if v.shape[1] == Hq else v.repeat_interleave(Hq // v.shape[1], dim=1)


def _softmax_rows(logits: Tensor, vis: Tensor, extra_logit: Tensor | None = None) -> Tensor:
    """Softmax over visible keys (plus an optional extra logit per head: (Hq,)); rows with nothing visible -> 0."""
    x = logits.masked_fill(~vis, float("-inf"))
    if extra_logit is not None:
        col = extra_logit.to(x.dtype)[None, :, None, None].expand(*x.shape[:-1], 1)
        x = torch.cat([x, col], dim=-1)
    m = x.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - m)
    z = e.sum(-1, keepdim=True)
    p = e / torch.where(z == 0, torch.ones_like(z), z)  # only an empty row divides by 1; a nan sum stays nan
    return p[..., :-1] if extra_logit is not None else p


def _nonfinite_queries_nan(w: Tensor, q: Tensor, alpha: Tensor | None = None) -> Tensor:
    """w: (B, Hq, T, S) weights; a query whose q row (or alpha) is not finite gets nan weights. Arithmetic alone
    gives nan for most such rows but not all (a -inf q whose logits are all -inf reads as a row that sees nothing);
    the library's rule is nan for every one (docs/reliability.md)."""
    ok = torch.isfinite(q).all(-1)
    if alpha is not None:
        ok = ok & torch.isfinite(alpha)
    return w.masked_fill(~ok[..., None], float("nan"))


def softmax_attention_reference(q, k, v, *, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                               window=None, document_ids=None, softcap=None, mask=None, score=None):
    """Plain softmax attention. q: (B, Hq, T, D), k, v: (B, Hkv, S, D) -> (out (B, Hq, T, D), w (B, Hq, T, S)).
    softcap (every reference): logits capped as in `attention_logits`. mask (every reference): a parsed MaskSpec
    instead of the mask keywords; score: a Score instead of scale and softcap (`attention_logits`)."""
    B, Hq, Hkv, T, S, D = check_qkv(q, k, v, enable_gqa)
    vis = _visible(mask, attn_mask, is_causal, T, S, q.device, window, document_ids)
    w = _softmax_rows(attention_logits(q, k, scale=scale, enable_gqa=enable_gqa, softcap=softcap, score=score), vis)
    w = _nonfinite_queries_nan(w, q)
    return w @ _expand_v(v, Hq), w


def sink_attention_reference(q, k, v, sinks, *, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                            window=None, document_ids=None, softcap=None, mask=None, score=None):
    """Sink attention; sinks: (Hq,). Returns (out (B, Hq, T, D), w (B, Hq, T, S)); sink mass = 1 - w.sum(-1)."""
    B, Hq, Hkv, T, S, D = check_qkv(q, k, v, enable_gqa)
    check_per_head("sinks", sinks, Hq, q.device)
    vis = _visible(mask, attn_mask, is_causal, T, S, q.device, window, document_ids)
    logits = attention_logits(q, k, scale=scale, enable_gqa=enable_gqa, softcap=softcap, score=score)
    w = _nonfinite_queries_nan(_softmax_rows(logits, vis, extra_logit=sinks), q)
    return w @ _expand_v(v, Hq), w


def affine_scaled_attention_reference(q, k, v, alpha, alpha_ma, *, attn_mask=None, is_causal=False, scale=None,
                                      bias_norm="visible", enable_gqa=False, window=None, document_ids=None,
                                      softcap=None, mask=None, score=None):
    """a_ij = alpha_i p_ij + (alpha_ma - alpha_i) / N_i on visible keys, 0 on masked keys.

    alpha: (B, Hq, T), alpha_ma: (Hq,). N_i = visible keys of query i ("visible") or S ("full").
    Returns (out (B, Hq, T, D), a (B, Hq, T, S)).
    """
    B, Hq, Hkv, T, S, D = check_qkv(q, k, v, enable_gqa)
    check_per_query("alpha", alpha, B, Hq, T, q.device)
    check_per_head("alpha_ma", alpha_ma, Hq, q.device)
    check_bias_norm(bias_norm)
    vis = _visible(mask, attn_mask, is_causal, T, S, q.device, window, document_ids)
    p = _softmax_rows(attention_logits(q, k, scale=scale, enable_gqa=enable_gqa, softcap=softcap, score=score), vis)
    vis = vis.expand(B, Hq, T, S)
    n = vis.sum(-1, keepdim=True).to(q.dtype) if bias_norm == "visible" else torch.full_like(p[..., :1], S)
    a_ = alpha.to(q.dtype)[..., None]
    beta = (alpha_ma.to(q.dtype)[None, :, None, None] - a_) / n.clamp(min=1)
    w = _nonfinite_queries_nan(torch.where(vis, a_ * p + beta, torch.zeros_like(p)), q, alpha)
    return w @ _expand_v(v, Hq), w
