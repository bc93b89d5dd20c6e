"""Affine-Scaled Attention, fast path: out_i = alpha_i * Attn_i + (alpha_ma - alpha_i) * mean of visible V.

The identity holds because beta_i = (alpha_ma - alpha_i) / N_i is added to each of the N_i visible keys, so
any softmax kernel plus a masked mean of V (prefix sums under a causal mask) gives the exact result. The combine
runs in the variant epilogue (epilogue.py), which also applies an output gate in the same pass.
"""
from __future__ import annotations

from torch import Tensor

from ._validate import check_per_head, check_per_query, check_v_mean
from .backends import attention_on
from .epilogue import gate4, run_checked
from .isolate import isolate_nonfinite, poison_seen
from .masks import MaskSpec
from .plan import make_plan
from .value_mean import ValueMean


def affine_scaled_attention(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, alpha_ma: Tensor, *,
                            attn_mask: Tensor | None = None, is_causal: bool = False, scale: float | None = None,
                            bias_norm: str = "visible", enable_gqa: bool = False, window: int | None = None,
                            document_ids: Tensor | None = None, backend: str | None = None,
                            v_mean: Tensor | None = None, mask: MaskSpec | None = None) -> Tensor:
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
    derive from it. A query that sees no key returns zeros.
    """
    return attention_with_epilogue(q, k, v, alpha=alpha, alpha_ma=alpha_ma, attn_mask=attn_mask,
                                   is_causal=is_causal, scale=scale, bias_norm=bias_norm, enable_gqa=enable_gqa,
                                   window=window, document_ids=document_ids, backend=backend, v_mean=v_mean,
                                   mask=mask)


def attention_with_epilogue(q: Tensor, k: Tensor, v: Tensor, *, alpha: Tensor | None = None,
                            alpha_ma: Tensor | None = None, gate: Tensor | float | None = None,
                            sinks: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False,
                            scale: float | None = None, bias_norm: str = "visible", enable_gqa: bool = False,
                            window: int | None = None, document_ids: Tensor | None = None,
                            backend: str | None = None, v_mean: Tensor | None = None,
                            epilogue_impl: str | None = None, mask: MaskSpec | None = None) -> Tensor:
    """Every variant's fast path: a softmax kernel (with the sink when sinks is given), then one epilogue pass.

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D); alpha: (B, Hq, T) with alpha_ma: (Hq,) for the affine part (or
    neither); gate: broadcastable to (B, Hq, T, D) or a float (see epilogue.epilogue); sinks: (Hq,) logits.
    Masks, scale, bias_norm, backend and v_mean as affine_scaled_attention; epilogue_impl forces "eager" or
    "triton"; mask: the mask already parsed (a MaskSpec, e.g. once per model forward) instead of the keywords.
    Returns (B, Hq, T, D) in q's dtype.
    """
    p = make_plan(q, k, v, mask=mask, attn_mask=attn_mask, is_causal=is_causal, window=window,
                  document_ids=document_ids, scale=scale, bias_norm=bias_norm, enable_gqa=enable_gqa,
                  backend=backend, needs_lse=sinks is not None, epilogue_impl=epilogue_impl)
    c = p.call
    B, Hq, Hkv, T, D = c.B, c.Hq, c.Hkv, c.T, c.D
    if (alpha is None) != (alpha_ma is None):
        raise ValueError("alpha (B, Hq, T) and alpha_ma (Hq,) come together (the affine part) or not at all")
    if alpha is not None:
        check_per_query("alpha", alpha, B, Hq, T, q.device)
        check_per_head("alpha_ma", alpha_ma, Hq, q.device)
    elif v_mean is not None:
        raise ValueError("v_mean is the affine bias term's mean of V: it needs alpha and alpha_ma")
    if sinks is not None:
        check_per_head("sinks", sinks, Hq, q.device)
    if v_mean is not None:
        check_v_mean(v_mean, B, Hq, Hkv, T, D, q.device)

    # A non-finite key or value that the mask hides must reach no output (isolate.py).
    mask = c.mask
    k, v, seen = isolate_nonfinite(k, v, mask, Hq)
    out, _ = attention_on(p.backend, q, k, v, mask, p.scale, sinks=sinks)
    # Every argument is checked above: the epilogue runs without checking them again (µs per decode step).
    impl, g = p.epilogue, gate4(gate, out)
    if alpha is None:
        return poison_seen(run_checked(impl, out, None, None, g, None, None, None), seen)
    if v_mean is None:
        mean = ValueMean(mask, Hq, bias_norm)
        if mean.has_transpose:
            # Prefix-sum masks: the epilogue recomputes the sums from v in backward instead of saving them.
            return poison_seen(run_checked(impl, out, alpha, alpha_ma, g, None, v, mean), seen)
        v_mean = mean.of(v)  # other masks: differentiated by autograd, kept for backward
    return poison_seen(run_checked(impl, out, alpha, alpha_ma, g, v_mean, None, None), seen)
