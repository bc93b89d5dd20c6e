"""Semantic properties of the ops: no leakage from the future, weights sum to alpha_ma, empty rows, decoding."""
import pytest
import torch

from affine_attention.ops import (
    affine_scaled_attention, affine_scaled_attention_reference, sink_attention, sink_attention_reference,
    softmax_attention,
)
from conftest import make_qkv

VARIANT_OPS = {
    "softmax": lambda q, k, v, kw: softmax_attention(q, k, v, **kw),
    "sink": lambda q, k, v, kw: sink_attention(q, k, v, torch.linspace(-1, 1, q.shape[1], dtype=q.dtype), **kw),
    "affine": lambda q, k, v, kw: affine_scaled_attention(
        q, k, v, torch.linspace(0, 1, q.shape[1] * q.shape[2], dtype=q.dtype).view(1, q.shape[1], -1).expand(
            q.shape[0], -1, -1), torch.full((q.shape[1],), 0.3, dtype=q.dtype), **kw),
}


@pytest.mark.parametrize("name", list(VARIANT_OPS))
@pytest.mark.parametrize("mask", ["none", "key_left"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_leakage_from_later_positions(name, mask, dtype):
    B, H, T, D = 2, 4, 29, 16
    q, k, v = make_qkv(B, H, 2, T, T, D, dtype=dtype, requires_grad=False)
    attn_mask = None
    if mask == "key_left":
        attn_mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
        attn_mask[1, ..., :4] = False
    kw = dict(attn_mask=attn_mask, is_causal=True, enable_gqa=True)
    base = VARIANT_OPS[name](q, k, v, kw)
    for i in (0, 7, 17, T - 2):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, i + 1:] = torch.randn_like(k2[:, :, i + 1:]) * 5
        v2[:, :, i + 1:] = torch.randn_like(v2[:, :, i + 1:]) * 5
        out = VARIANT_OPS[name](q, k2, v2, kw)
        assert torch.equal(out[:, :, :i + 1], base[:, :, :i + 1]), f"position <= {i} changed"


@pytest.mark.parametrize("mask", ["none", "key_left", "dense"])
def test_affine_rows_sum_to_alpha_ma(mask):
    B, H, T = 2, 3, 17
    q, k, v = make_qkv(B, H, H, T, T, 8, requires_grad=False)
    alpha, alpha_ma = torch.rand(B, H, T, dtype=q.dtype), torch.rand(H, dtype=q.dtype)
    attn_mask = None
    if mask == "key_left":
        attn_mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
        attn_mask[0, ..., :5] = False
    elif mask == "dense":
        attn_mask = torch.rand(B, 1, T, T) > 0.5
    _, w = affine_scaled_attention_reference(q, k, v, alpha, alpha_ma, attn_mask=attn_mask, is_causal=True)
    vis = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & (attn_mask if attn_mask is not None else True)
    has_key = vis.expand(B, H, T, T).any(-1)
    sums = w.sum(-1)
    torch.testing.assert_close(sums[has_key], alpha_ma[None, :, None].expand(B, H, T)[has_key])
    assert torch.all(sums[~has_key] == 0)
    assert torch.all(w[~vis.expand(B, H, T, T)] == 0), "bias leaked onto masked keys"


@pytest.mark.parametrize("name", list(VARIANT_OPS))
def test_query_without_visible_key_returns_zero(name):
    B, H, T = 2, 2, 6
    q, k, v = make_qkv(B, H, H, T, T, 8, dtype=torch.float32)
    attn_mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
    attn_mask[0, ..., :3] = False  # left padding: queries 0..2 of batch 0 see nothing under the causal rule
    out = VARIANT_OPS[name](q, k, v, dict(attn_mask=attn_mask, is_causal=True))
    assert torch.all(out[0, :, :3] == 0)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("name", list(VARIANT_OPS))
def test_single_token_decoding_equals_full_forward(name):
    """Causal alignment is bottom-right: the last query after a cache sees every key."""
    B, H, T = 2, 4, 23
    q, k, v = make_qkv(B, H, 2, T, T, 8, requires_grad=False)
    kw = dict(is_causal=True, enable_gqa=True)
    full = VARIANT_OPS[name](q, k, v, kw)
    for t in (0, 5, T - 1):
        if name == "affine":  # alpha differs per position; take the matching slice
            alpha = torch.linspace(0, 1, H * T, dtype=q.dtype).view(1, H, T).expand(B, -1, -1)[:, :, t:t + 1]
            step = affine_scaled_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], alpha,
                                           torch.full((H,), 0.3, dtype=q.dtype), **kw)
        else:
            step = VARIANT_OPS[name](q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], kw)
        torch.testing.assert_close(step, full[:, :, t:t + 1], rtol=1e-12, atol=1e-12)


def test_chunked_prefill_after_cache_equals_full_forward():
    B, H, T, C = 1, 2, 20, 7
    q, k, v = make_qkv(B, H, H, T, T, 8, requires_grad=False)
    sinks = torch.randn(H, dtype=q.dtype)
    full = sink_attention(q, k, v, sinks, is_causal=True)
    chunk = sink_attention(q[:, :, T - C:], k, v, sinks, is_causal=True)
    torch.testing.assert_close(chunk, full[:, :, T - C:])


def test_sink_weights_leave_mass_for_the_sink():
    q, k, v = make_qkv(1, 2, 2, 5, 5, 4, requires_grad=False)
    _, w = sink_attention_reference(q, k, v, torch.tensor([0.0, 3.0], dtype=q.dtype), is_causal=True)
    sums = w.sum(-1)
    assert torch.all(sums < 1) and torch.all(sums > 0)
    assert torch.all(sums[:, 1] < sums[:, 0]), "a larger sink logit must take more mass"
