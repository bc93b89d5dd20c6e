"""Fast paths against the float64 reference, on outputs and every gradient, over odd shapes and masks."""
import pytest
import torch

from affine_attention.ops import (
    affine_scaled_attention, affine_scaled_attention_reference, off_by_one_attention, sink_attention,
    sink_attention_reference, softmax_attention, softmax_attention_reference,
)
from conftest import make_qkv

# (B, Hq, Hkv, T, S): T not a multiple of 8, GQA, T < S (after a cache), T = 1 (decoding), T > S.
SHAPES = [(2, 4, 2, 37, 37), (2, 4, 4, 1, 19), (1, 6, 3, 5, 13), (2, 4, 2, 13, 5), (2, 2, 1, 7, 7),
          (1, 3, 3, 300, 300)]
MASKS = ["none", "key_left", "key_right", "dense"]


def _mask(kind, B, T, S):
    if kind == "none":
        return None
    if kind == "key_left":  # left padding, as in batched generation
        m = torch.ones(B, 1, 1, S, dtype=torch.bool)
        m[0, ..., :3] = False
        return m
    if kind == "key_right":
        m = torch.ones(B, S, dtype=torch.bool)[:, None, None, :].clone()
        m[-1, ..., S - 2:] = False
        return m
    return torch.rand(B, 1, T, S) > 0.3


def _ops():
    return ["affine", "affine_full", "sink", "off_by_one", "softmax"]


def _call(name, q, k, v, extra, kw):
    if name.startswith("affine"):
        alpha, alpha_ma = extra
        bn = "full" if name == "affine_full" else "visible"
        fast = affine_scaled_attention(q, k, v, alpha, alpha_ma, bias_norm=bn, **kw)
        ref = affine_scaled_attention_reference(q, k, v, alpha, alpha_ma, bias_norm=bn, **kw)[0]
    elif name == "sink":
        fast = sink_attention(q, k, v, extra[0], **kw)
        ref = sink_attention_reference(q, k, v, extra[0], **kw)[0]
    elif name == "off_by_one":
        fast = off_by_one_attention(q, k, v, **kw)
        ref = sink_attention_reference(q, k, v, torch.zeros(q.shape[1], dtype=q.dtype), **kw)[0]
    else:
        fast = softmax_attention(q, k, v, **kw)
        ref = softmax_attention_reference(q, k, v, **kw)[0]
    return fast, ref


def _extra(name, B, Hq, T, dtype=torch.float64):
    if name.startswith("affine"):
        return (torch.rand(B, Hq, T, dtype=dtype, requires_grad=True), torch.rand(Hq, dtype=dtype))
    if name == "sink":
        return (torch.randn(Hq, dtype=dtype, requires_grad=True),)
    return ()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", _ops())
def test_fast_path_matches_float64_reference(shape, mask, causal, name):
    B, Hq, Hkv, T, S = shape
    if T == 300 and mask == "dense":
        pytest.skip("large dense mask adds nothing over the small ones")
    q, k, v = make_qkv(B, Hq, Hkv, T, S, 8)
    extra = _extra(name, B, Hq, T)
    kw = dict(attn_mask=_mask(mask, B, T, S), is_causal=causal, enable_gqa=Hq != Hkv)
    fast, ref = _call(name, q, k, v, extra, kw)
    assert not torch.isnan(fast).any()
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)
    inputs = [q, k, v] + [x for x in extra if x.requires_grad]
    g = torch.randn_like(fast)
    for gf, gr in zip(torch.autograd.grad(fast, inputs, g), torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(gf, gr, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", _ops())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_float32_within_1e5_of_float64(name, causal):
    B, Hq, Hkv, T, S = 2, 4, 2, 45, 45
    q, k, v = make_qkv(B, Hq, Hkv, T, S, 16)
    extra = _extra(name, B, Hq, T)
    kw = dict(attn_mask=_mask("key_left", B, T, S), is_causal=causal, enable_gqa=True)
    _, ref = _call(name, q, k, v, extra, kw)
    inputs64 = [q, k, v] + [x for x in extra if x.requires_grad]
    g = torch.randn_like(ref)
    grads64 = torch.autograd.grad(ref, inputs64, g)

    lo = [x.detach().float().requires_grad_(x.requires_grad) for x in (q, k, v, *extra)]
    fast, _ = _call(name, *lo[:3], tuple(lo[3:]), kw)
    inputs32 = [x for x in lo if x.requires_grad]
    grads32 = torch.autograd.grad(fast, inputs32, g.float())
    for a, b in [(fast, ref)] + list(zip(grads32, grads64)):
        err = (a.double() - b).abs().max() / b.abs().max().clamp(min=1e-12)
        assert err <= 1e-5, f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["affine", "sink", "softmax"])
def test_low_precision_close_to_float64(dtype, name):
    """Half inputs work; the affine mean of V accumulates in float32 so a long prefix does not drift."""
    B, Hq, Hkv, T, S = 1, 2, 1, 1024, 1024
    q, k, v = make_qkv(B, Hq, Hkv, T, S, 16, requires_grad=False)
    v = v + 3.0  # a large common offset makes a half-precision prefix sum visibly wrong
    extra = _extra(name, B, Hq, T)
    kw = dict(is_causal=True, enable_gqa=True)
    _, ref = _call(name, q, k, v, extra, kw)
    fast, _ = _call(name, q.to(dtype), k.to(dtype), v.to(dtype), tuple(x.to(dtype) for x in extra), kw)
    assert fast.dtype == dtype
    err = (fast.double() - ref).abs().max().item()
    tol = 0.05 if dtype == torch.bfloat16 else 0.01
    assert err < tol * ref.abs().max().item(), err


def test_affine_with_alpha_one_and_equal_ma_is_softmax():
    q, k, v = make_qkv(2, 3, 3, 9, 9, 8, requires_grad=False)
    out = affine_scaled_attention(q, k, v, torch.ones(2, 3, 9, dtype=q.dtype), torch.ones(3, dtype=q.dtype),
                                  is_causal=True)
    torch.testing.assert_close(out, softmax_attention_reference(q, k, v, is_causal=True)[0])


def test_precomputed_v_mean_equals_internal_mean():
    q, k, v = make_qkv(2, 4, 2, 1, 11, 8, requires_grad=False)
    alpha, alpha_ma = torch.rand(2, 4, 1, dtype=q.dtype), torch.rand(4, dtype=q.dtype)
    v_mean = v.mean(-2, keepdim=True)  # (B, Hkv, 1, D): the running-sum form decoding uses
    a = affine_scaled_attention(q, k, v, alpha, alpha_ma, is_causal=True, enable_gqa=True)
    b = affine_scaled_attention(q, k, v, alpha, alpha_ma, is_causal=True, enable_gqa=True, v_mean=v_mean)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["affine", "sink"])
def test_low_precision_gradients_close_to_float64(dtype, name):
    B, Hq, Hkv, T = 1, 4, 2, 200
    q, k, v = make_qkv(B, Hq, Hkv, T, T, 32)
    extra = _extra(name, B, Hq, T)
    kw = dict(attn_mask=_mask("key_left", B, T, T), is_causal=True, enable_gqa=True)
    _, ref = _call(name, q, k, v, extra, kw)
    g = torch.randn_like(ref)
    inputs = [q, k, v] + [x for x in extra if x.requires_grad]
    grads64 = torch.autograd.grad(ref, inputs, g)
    lo = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    lo_extra = tuple(x.detach().float().requires_grad_(x.requires_grad) for x in extra)  # params stay fp32
    fast, _ = _call(name, *lo, lo_extra, kw)
    grads = torch.autograd.grad(fast, lo + [x for x in lo_extra if x.requires_grad], g.to(dtype))
    tol = 0.03 if dtype == torch.bfloat16 else 0.005
    for a, b in [(fast, ref)] + list(zip(grads, grads64)):
        assert torch.isfinite(a).all()
        assert (a.double() - b).abs().max() <= tol * b.abs().max()
