"""The per-call plan memo (ops/plan.py): repeated calls reuse one plan, and nothing a remembered plan skips can go
stale or let a bad argument through: changed masks, forced backends, grad mode, argument types."""
from collections import OrderedDict

import pytest
import torch

from affine_attention.ops import affine_scaled_attention, affine_scaled_attention_reference, softmax_attention
from affine_attention.ops import plan as plan_mod
from affine_attention.ops.backends import use_backend


@pytest.fixture
def counted(monkeypatch):
    """Fresh memos, and the number of plans actually made."""
    monkeypatch.setattr(plan_mod, "_SHAPE_PLANS", OrderedDict())
    monkeypatch.setattr(plan_mod, "_TENSOR_PLANS", plan_mod.TensorMemo(8))
    made = []
    make = plan_mod.make_plan
    monkeypatch.setattr(plan_mod, "make_plan", lambda *a, **k: made.append(1) or make(*a, **k))
    return made


def _qkv(T=1, S=11, Hkv=2, dtype=torch.float64):
    return (torch.randn(2, 4, T, 8, dtype=dtype), torch.randn(2, Hkv, S, 8, dtype=dtype),
            torch.randn(2, Hkv, S, 8, dtype=dtype))


def test_every_layer_of_a_step_shares_one_plan(counted):
    q, k, v = _qkv()
    alpha, alpha_ma = torch.rand(2, 4, 1, dtype=torch.float64), torch.rand(4, dtype=torch.float64)
    with torch.no_grad():
        outs = [affine_scaled_attention(q, k, v, alpha, alpha_ma, is_causal=True, enable_gqa=True)
                for _ in range(5)]
    assert len(counted) == 1
    ref = affine_scaled_attention_reference(q, k, v, alpha, alpha_ma, is_causal=True, enable_gqa=True)[0]
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # a new cache length (the next decoding step) is a new call
    q2, k2, v2 = _qkv(S=12)
    with torch.no_grad():
        affine_scaled_attention(q2, k2, v2, alpha, alpha_ma, is_causal=True, enable_gqa=True)
    assert len(counted) == 2


def test_a_key_mask_written_in_place_is_planned_again(counted):
    q, k, v = _qkv(T=5, S=11)
    keys = torch.ones(2, 1, 1, 11, dtype=torch.bool)
    softmax_attention(q, k, v, attn_mask=keys, is_causal=True, enable_gqa=True)
    softmax_attention(q, k, v, attn_mask=keys, is_causal=True, enable_gqa=True)
    assert len(counted) == 1
    keys[1, ..., :4] = False
    out = softmax_attention(q, k, v, attn_mask=keys, is_causal=True, enable_gqa=True)
    assert len(counted) == 2
    ref = softmax_attention(q, k, v, attn_mask=keys.clone(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_dense_masks_are_not_kept(counted):
    q, k, v = _qkv(T=5, S=11)
    dense = torch.rand(2, 1, 5, 11) > 0.3
    dense[..., -1] = True
    for _ in range(2):
        softmax_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    assert len(counted) == 2 and len(plan_mod._TENSOR_PLANS) == 0 and not plan_mod._SHAPE_PLANS


def test_document_ids_changed_in_place_are_checked_again(counted):
    q, k, v = _qkv(T=6, S=6)
    docs = torch.tensor([[0, 0, 1, 1, 2, 2]] * 2)
    softmax_attention(q, k, v, is_causal=True, document_ids=docs, enable_gqa=True)
    softmax_attention(q, k, v, is_causal=True, document_ids=docs, enable_gqa=True)
    assert len(counted) == 1
    docs[0, 3] = 0
    with pytest.raises(ValueError, match="non-decreasing"):
        softmax_attention(q, k, v, is_causal=True, document_ids=docs, enable_gqa=True)


@pytest.mark.parametrize("bad, match", [
    (dict(is_causal=1), "is_causal must be a bool"),
    (dict(scale=True), "scale must be a finite positive number"),
    (dict(window=True), "window must be a positive int"),
    (dict(bias_norm=["visible"]), "bias_norm must be"),
    (dict(backend="cuda_flash"), "cannot serve this call"),
    (dict(enable_gqa=False), "pass enable_gqa=True"),
])
def test_a_remembered_plan_lets_no_bad_argument_through(counted, bad, match):
    q, k, v = _qkv(T=3, S=3)
    alpha, alpha_ma = torch.rand(2, 4, 3, dtype=torch.float64), torch.rand(4, dtype=torch.float64)
    good = dict(is_causal=True, scale=1.0, window=2, bias_norm="visible", enable_gqa=True)
    affine_scaled_attention(q, k, v, alpha, alpha_ma, **good)
    with pytest.raises(ValueError, match=match):
        affine_scaled_attention(q, k, v, alpha, alpha_ma, **{**good, **bad})


def test_other_tensors_of_the_same_shapes_are_still_checked(counted):
    q, k, v = _qkv(T=3, S=3)
    softmax_attention(q, k, v, is_causal=True, enable_gqa=True)
    with pytest.raises(ValueError, match="share one dtype"):
        softmax_attention(q, k.float(), v, is_causal=True, enable_gqa=True)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        softmax_attention(q, k, v[:, :, :2], is_causal=True, enable_gqa=True)


def test_forcing_a_backend_or_grad_mode_makes_a_new_plan(counted):
    q, k, v = _qkv(T=4, S=4)
    softmax_attention(q, k, v, is_causal=True, enable_gqa=True)
    auto = next(iter(plan_mod._SHAPE_PLANS.values())).backend.name
    with use_backend("exact"):
        softmax_attention(q, k, v, is_causal=True, enable_gqa=True)
    names = [p.backend.name for p in plan_mod._SHAPE_PLANS.values()]
    assert names == [auto, "exact"] and auto != "exact"
    q.requires_grad_()
    softmax_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    assert len(counted) == 3 and q.grad is not None


def test_decoding_keeps_only_the_most_recent_plans(counted):
    """A new cache length every step: the memo stays bounded, the oldest plans go first."""
    for S in range(3, 3 + 3 * plan_mod._SIZE):
        q, k, v = _qkv(S=S)
        softmax_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert len(plan_mod._SHAPE_PLANS) == plan_mod._SIZE
    kept = sorted(key[1][2] for key in plan_mod._SHAPE_PLANS)  # k.shape's S
    assert kept == list(range(3 + 2 * plan_mod._SIZE, 3 + 3 * plan_mod._SIZE))
