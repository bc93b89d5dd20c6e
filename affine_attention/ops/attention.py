"""The public attention ops, and the one fast path behind all of them: a softmax kernel, then the variant epilogue.

Affine-Scaled Attention: a_ij = alpha_i * softmax_j(x_ij) + beta_i with beta_i = (alpha_ma - alpha_i) / N_i on each
of the N_i keys query i may see, so out_i = alpha_i * Attn_i + (alpha_ma - alpha_i) * (mean of visible V): any
softmax kernel (backends/) plus a masked mean of V gives the exact result, combined in one pass (epilogue.py). The
sink adds exp(s) to the kernel's softmax denominator; a gate multiplies the output in the same epilogue pass.
The readable, weight-materialising form of every op is reference.py.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import backends, nonfinite
from ._validate import check_bias_norm, check_per_head, check_qkv, check_v_mean
from .call import AttentionCall
from .epilogue import epilogue, select_impl
from .masks import MaskSpec


def affine_scaled_attention(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, alpha_ma: Tensor, *,
                            attn_mask: Tensor | None = None, is_causal: bool = False, scale: float | None = None,
                            bias_norm: str = "visible", enable_gqa: bool = False, window: int | None = None,
                            document_ids: Tensor | None = None, backend: str | None = None,
                            v_mean: Tensor | None = None, mask: MaskSpec | None = None,
                            softcap: float | None = None) -> Tensor:
    """Affine-Scaled Attention: a_ij = alpha_i * softmax_j(q_i.k_j * scale) + (alpha_ma - alpha_i) / N_i.

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D); alpha: (B, Hq, T); alpha_ma: (Hq,). Returns (B, Hq, T, D).
    attn_mask: bool broadcastable to (B, Hq, T, S), True = may attend. is_causal aligns the last query with the
    last key (bottom-right), so T < S continues a cache. N_i is the number of keys query i may see
    (bias_norm="visible"); bias_norm="full" uses N = S for every query and exists only as an ablation.
    window: each query sees at most its last `window` keys (needs is_causal). document_ids: (B, S) int,
    non-decreasing: a query sees only keys of its own document. backend: force a kernel backend by name.
    v_mean: optional precomputed mean of the visible values, (B, Hkv, T, D) float32, e.g. from a decoding
    cache's running sum; it replaces the masked mean and must follow the same bias_norm.
    mask: the mask already parsed (`ops.masks.parse_mask`, a MaskSpec) instead of attn_mask / is_causal / window /
    document_ids: parsed once, it serves many calls (every layer of a model forward) and kernels keep what they
    derive from it. softcap: logits capped to softcap * tanh(x / softcap) before the softmax (Gemma 2; only the
    exact backend caps). A query that sees no key returns zeros.
    """
    if alpha is None or alpha_ma is None:
        raise ValueError("affine_scaled_attention needs alpha (B, Hq, T) and alpha_ma (Hq,)")
    return attention_with_epilogue(q, k, v, alpha=alpha, alpha_ma=alpha_ma, attn_mask=attn_mask,
                                   is_causal=is_causal, scale=scale, bias_norm=bias_norm, enable_gqa=enable_gqa,
                                   window=window, document_ids=document_ids, backend=backend, v_mean=v_mean,
                                   mask=mask, softcap=softcap)


def sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, *, attn_mask: Tensor | None = None,
                   is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                   window: int | None = None, document_ids: Tensor | None = None,
                   backend: str | None = None, mask: MaskSpec | None = None,
                   softcap: float | None = None) -> Tensor:
    """Attention with a sink (GPT-OSS style): p_ij = exp(x_ij) / (sum_k exp(x_ik) + exp(sinks[h])).

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D); sinks: (Hq,) logits, learnable. Returns (B, Hq, T, D).
    Mask semantics (attn_mask, is_causal, window, document_ids, or mask=), backend and softcap as
    affine_scaled_attention.
    """
    if not isinstance(sinks, Tensor):
        raise ValueError(f"sinks must be a (Hq,) tensor of sink logits, got {type(sinks).__name__}")
    return attention_with_epilogue(q, k, v, sinks=sinks, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                   enable_gqa=enable_gqa, window=window, document_ids=document_ids, backend=backend,
                                   mask=mask, softcap=softcap)


def off_by_one_attention(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None,
                         is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                         window: int | None = None, document_ids: Tensor | None = None,
                         backend: str | None = None, mask: MaskSpec | None = None,
                         softcap: float | None = None) -> Tensor:
    """Softmax with +1 in the denominator: sink_attention with every sink logit fixed at 0.

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D). Returns (B, Hq, T, D).
    """
    if not isinstance(q, Tensor):
        check_qkv(q, k, v, enable_gqa)  # raises, naming q
    sinks = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device)
    return sink_attention(q, k, v, sinks, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                          enable_gqa=enable_gqa, window=window, document_ids=document_ids, backend=backend,
                          mask=mask, softcap=softcap)


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None,
                      is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                      window: int | None = None, document_ids: Tensor | None = None,
                      backend: str | None = None, mask: MaskSpec | None = None,
                      softcap: float | None = None) -> Tensor:
    """Standard attention with this library's mask semantics (causal aligned bottom-right, empty rows -> 0).

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D). Returns (B, Hq, T, D).
    """
    return attention_with_epilogue(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                   enable_gqa=enable_gqa, window=window, document_ids=document_ids, backend=backend,
                                   mask=mask, softcap=softcap)


def attention_with_epilogue(q: Tensor, k: Tensor, v: Tensor, *, alpha: Tensor | None = None,
                            alpha_ma: Tensor | None = None, gate: Tensor | float | None = None,
                            sinks: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False,
                            scale: float | None = None, bias_norm: str = "visible", enable_gqa: bool = False,
                            window: int | None = None, document_ids: Tensor | None = None,
                            backend: str | None = None, v_mean: Tensor | None = None,
                            epilogue_impl: str | None = None, mask: MaskSpec | None = None,
                            kv_nonfinite: Tensor | bool | None = None, softcap: float | None = None) -> Tensor:
    """Every variant's fast path: a softmax kernel (with the sink when sinks is given), then one epilogue pass.

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D); alpha: (B, Hq, T) with alpha_ma: (Hq,) for the affine part (or
    neither); gate: broadcastable to (B, Hq, T, D) or a float (see epilogue.epilogue); sinks: (Hq,) logits.
    Masks, scale, bias_norm, backend and v_mean as affine_scaled_attention; epilogue_impl forces "eager" or
    "triton" for the epilogue and the non-finite rule's passes (ops/nonfinite.py); mask: the mask already parsed (a MaskSpec, e.g. once per model forward) instead of the keywords.
    kv_nonfinite: (B, Hkv) bool, True for the heads whose k or v hold a non-finite row, or False for none, where the
    caller tracks it (a decoding cache, from the rows each step appends): it spares the test of every row.
    softcap: logits capped to softcap * tanh(x / softcap) in the kernel (backends that cannot cap refuse the call).
    Returns (B, Hq, T, D) in q's dtype.
    """
    call = AttentionCall.of(q, k, v, attn_mask=attn_mask, is_causal=is_causal, window=window,
                            document_ids=document_ids, mask=mask, scale=scale, softcap=softcap, enable_gqa=enable_gqa,
                            v_mean=v_mean, kv_nonfinite=kv_nonfinite, backend=backend)
    return attend_call(call, alpha=alpha, alpha_ma=alpha_ma, gate=gate, sinks=sinks, bias_norm=bias_norm,
                       epilogue_impl=epilogue_impl)


def attend_call(call: AttentionCall, *, alpha: Tensor | None = None, alpha_ma: Tensor | None = None,
                gate: Tensor | float | None = None, sinks: Tensor | None = None, bias_norm: str = "visible",
                epilogue_impl: str | None = None) -> Tensor:
    """The fast path of one AttentionCall (see attention_with_epilogue for alpha, alpha_ma, gate, sinks, bias_norm
    and epilogue_impl): the call's score.q_scale folded into q, its mask and score handed to the kernel, then the
    epilogue. Returns (B, Hq, T, D) in q's dtype."""
    q, k, v, mask, score = call.q, call.k, call.v, call.mask, call.score
    v_mean, kv_nonfinite = call.cache.v_mean, call.cache.kv_nonfinite
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    check_bias_norm(bias_norm)
    if (alpha is None) != (alpha_ma is None):
        raise ValueError("alpha (B, Hq, T) and alpha_ma (Hq,) come together (the affine part) or not at all")
    if alpha is None and v_mean is not None:
        raise ValueError("v_mean is the affine bias term's mean of V: it needs alpha and alpha_ma")
    if v_mean is not None:
        check_v_mean(v_mean, B, Hq, Hkv, T, D, q.device)
    if sinks is not None:
        check_per_head("sinks", sinks, Hq, q.device)
    impl = select_impl(q.device, epilogue_impl)  # a forced implementation that cannot run fails before the kernel
    if q.numel() == 0:
        # No query (B, Hq or T is 0): an empty output, as SDPA gives; kernels are not called on empty tensors.
        # Its zero-sum term keeps every tensor input in the graph, so backward gives them (zero) gradients.
        inputs = (q, k, v, alpha, alpha_ma, sinks, gate, v_mean, score.q_scale)
        return q.new_zeros((B, Hq, T, D)) + sum(t.sum() * 0 for t in inputs if isinstance(t, Tensor)).to(q.dtype)

    if kv_nonfinite is not None and kv_nonfinite is not False and (
            not isinstance(kv_nonfinite, Tensor) or kv_nonfinite.dtype != torch.bool
            or tuple(kv_nonfinite.shape) != (B, Hkv)):
        raise ValueError(f"kv_nonfinite must be a (B, Hkv) = {(B, Hkv)} bool tensor or False, got "
                         f"{tuple(kv_nonfinite.shape) if isinstance(kv_nonfinite, Tensor) else kv_nonfinite!r}")
    if score.q_scale is not None:
        # (s q).k = s (q.k): every kernel serves a per-query logit scale, and autograd carries its gradient.
        q = q * score.q_scale.to(q.dtype)[..., None]
        score = score._replace(q_scale=None)
    k, v, seen = nonfinite.isolate(q, k, v, mask, score.scale, kv_nonfinite, impl)
    out, _ = backends.attention(q, k, v, mask, score, sinks=sinks, backend=call.backend)
    if alpha is not None and v_mean is None:
        out = epilogue(out, alpha=alpha, alpha_ma=alpha_ma, gate=gate, v=v, mask=mask, bias_norm=bias_norm,
                       impl=impl)
    else:
        out = epilogue(out, alpha=alpha, alpha_ma=alpha_ma, gate=gate, v_mean=v_mean, impl=impl)
    return nonfinite.poison(out, seen, q, alpha, impl)
