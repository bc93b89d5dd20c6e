"""Variant modules: registry and options, agreement with the reference, and the alpha_ma buffer's semantics."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from affine_attention.variants import (
    AttentionShape, build_variant, get_variant, is_control, linear_clip, parse_options, variant_names,
)
from affine_attention.variants.running_stats import step_running_stats
from conftest import make_qkv

SHAPE = AttentionShape(hidden_size=24, num_heads=4, num_kv_heads=2, head_dim=8)
ALL = variant_names()
CONFIGS = [(n, {}) for n in ALL] + [
    ("gated", {"gate": "headwise"}), ("affine", {"activation": "sigmoid"}), ("affine", {"bias_norm": "full"}),
    ("affine_frozen", {"frozen_alpha": 0.5}), ("scaled_softmax", {"learnable": True}),
]


def _perturbed(name, options, dtype=torch.float64):
    """A variant whose new parameters are away from their init, so a wrong formula cannot hide."""
    m = build_variant(name, SHAPE, **options).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        if hasattr(m, "alpha_ma"):
            m.alpha_ma.copy_(torch.rand_like(m.alpha_ma))
    return m.eval()


@pytest.mark.parametrize("name, options", CONFIGS, ids=[f"{n}-{o}" for n, o in CONFIGS])
@pytest.mark.parametrize("T, S, mask", [(13, 13, None), (1, 9, None), (11, 11, "pad")])
def test_variant_matches_reference_outputs_and_gradients(name, options, T, S, mask):
    B = 2
    m = _perturbed(name, options)
    q, k, v = make_qkv(B, 4, 2, T, S, 8)
    x = torch.randn(B, T, 24, dtype=torch.float64, requires_grad=True)
    attn_mask = None
    if mask == "pad":
        attn_mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
        attn_mask[1, ..., :2] = False
    out = m(q, k, v, x, attn_mask=attn_mask, is_causal=True)
    ref, w, extras = m.reference(q, k, v, x, attn_mask=attn_mask, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert w.shape == (B, 4, T, S)
    inputs = [q, k, v, x] + list(m.parameters())
    g = torch.randn_like(out)
    ga = torch.autograd.grad(out, inputs, g, allow_unused=True)
    gr = torch.autograd.grad(ref, inputs, g, allow_unused=True)
    for a, b in zip(ga, gr):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_new_parameters_and_their_init():
    a = build_variant("affine", SHAPE)
    assert a.alpha_proj.weight.shape == (4, 24) and a.alpha_proj.bias is None
    assert torch.all(a.alpha_proj.weight == 0) and torch.all(a.alpha_ma == 0)
    x = torch.randn(2, 3, 24)
    assert torch.all(a.compute_alpha(x) == 0.5)
    assert build_variant("gated", SHAPE).gate_proj.weight.shape == (32, 24)
    assert build_variant("gated", SHAPE, gate="headwise").gate_proj.weight.shape == (4, 24)
    assert build_variant("sink", SHAPE).sinks.shape == (4,)
    assert len(list(build_variant("off_by_one", SHAPE).parameters())) == 0
    assert not hasattr(build_variant("affine_frozen", SHAPE, frozen_alpha=0.5), "alpha_proj")
    assert sum(p.numel() for p in build_variant("affine_gated", SHAPE).parameters()) == 4 * 24 + 32 * 24


def test_linear_clip_is_the_papers_phi():
    x = torch.tensor([-7.0, -5.0, -2.0, 0.0, 3.0, 5.0, 9.0])
    torch.testing.assert_close(linear_clip(x), torch.tensor([0.0, 0.0, 0.3, 0.5, 0.8, 1.0, 1.0]))


def test_scaled_softmax_with_scale_one_is_softmax_exactly():
    q, k, v = make_qkv(2, 4, 2, 7, 7, 8, requires_grad=False)
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    a = build_variant("scaled_softmax", SHAPE, scale=1.0).double()(q, k, v, x, is_causal=True)
    b = build_variant("softmax", SHAPE).double()(q, k, v, x, is_causal=True)
    assert torch.equal(a, b)
    assert is_control("scaled_softmax") and is_control("affine_frozen") and not is_control("affine")


def test_affine_frozen_has_no_alpha_projection_and_alpha_ma_converges_to_the_constant():
    m = build_variant("affine_frozen", SHAPE).double().train()
    assert not hasattr(m, "alpha_proj") and m.options.frozen_alpha == 0.5
    q, k, v = make_qkv(1, 4, 2, 5, 5, 8, requires_grad=False)
    x = torch.randn(1, 5, 24, dtype=torch.float64)
    for _ in range(200):
        m(q, k, v, x, is_causal=True)
        step_running_stats(m)
    torch.testing.assert_close(m.alpha_ma, torch.full((4,), 0.5, dtype=torch.float64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name, options, match", [
    ("softmaxx", {}, r"unknown attention variant 'softmaxx'; choose one of"),
    ("affine", {"momentun": 0.9}, r"unknown option\(s\) \['momentun'\]; valid options: activation"),
    ("affine", {"momentum": 1.5}, r"momentum' must lie in \[0, 1\]"),
    ("affine", {"momentum": -0.1}, r"momentum' must lie in \[0, 1\]"),
    ("affine", {"activation": "relu"}, r"activation' must be one of \['linear_clip', 'sigmoid'\]"),
    ("gated", {"gate": "channel"}, r"gate' must be one of"),
    ("sink", {"init": "zero"}, r"init' must be a number"),
    ("softmax", {"anything": 1}, r"valid options: none"),
    ("affine_frozen", {"frozen_alpha": None}, r"must be a number in \[0, 1\]"),
    ("affine_frozen", {"frozen_alpha": 1.5}, r"frozen_alpha' must lie in \[0, 1\]"),
])
def test_bad_variant_or_options_raise(name, options, match):
    with pytest.raises(ValueError, match=match):
        parse_options(name, options)


def test_alpha_ma_update_rule_eval_freeze_and_padding():
    m = build_variant("affine", SHAPE, momentum=0.8).double().train()
    with torch.no_grad():
        m.alpha_proj.weight.normal_()
    q, k, v = make_qkv(2, 4, 2, 6, 6, 8, requires_grad=False)
    x = torch.randn(2, 6, 24, dtype=torch.float64)
    token_mask = torch.ones(2, 6, dtype=torch.bool)
    token_mask[0, :2] = False
    expected = torch.zeros(4, dtype=torch.float64)
    for _ in range(3):
        alpha = m.compute_alpha(x)  # (B, H, T)
        mean = (alpha * token_mask[:, None]).sum((0, 2)) / token_mask.sum()
        expected = 0.8 * expected + 0.2 * mean
        m(q, k, v, x, is_causal=True, token_mask=token_mask)
        assert step_running_stats(m) == 1
        torch.testing.assert_close(m.alpha_ma.double(), expected.float().double(), rtol=1e-6, atol=1e-7)
    frozen = m.alpha_ma.clone()
    m.eval()
    m(q, k, v, x, is_causal=True)
    assert not m.alpha_acc.any()  # eval forwards accumulate nothing
    step_running_stats(m)
    assert torch.equal(m.alpha_ma, frozen)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_updates_alpha_ma_once(reentrant):
    torch.manual_seed(1)
    m = build_variant("affine", SHAPE).train()
    with torch.no_grad():
        m.alpha_proj.weight.normal_()
    q, k, v = make_qkv(2, 4, 2, 6, 6, 8, dtype=torch.float32)
    x = torch.randn(2, 6, 24, requires_grad=True)
    leaves = (q, k, v, x, m.alpha_proj.weight)

    def grads_of(out):
        for t in leaves:
            t.grad = None
        out.sum().backward()  # reentrant checkpointing supports .backward() only
        return [t.grad.clone() for t in leaves]

    out_plain = m(q, k, v, x, is_causal=True)
    grads_plain = grads_of(out_plain)
    after_one = m.alpha_acc.clone()
    assert after_one[-1] == 2 * 6

    m.alpha_acc.zero_()
    out_ckpt = checkpoint(lambda *a: m(*a, is_causal=True), q, k, v, x, use_reentrant=reentrant)
    grads_ckpt = grads_of(out_ckpt)
    assert torch.equal(m.alpha_acc, after_one), "recomputation in backward accumulated alpha again"
    torch.testing.assert_close(out_ckpt, out_plain)
    for a, b in zip(grads_ckpt, grads_plain):
        torch.testing.assert_close(a, b)


def test_every_registered_variant_is_constructible_and_named():
    for name in ALL:
        assert get_variant(name).name == name
        build_variant(name, SHAPE)


def test_affine_checkpoint_options_of_older_versions_still_parse():
    """frozen_alpha moved to the affine_frozen control; configs saved with affine's old neutral None still load,
    any other value is refused."""
    from affine_attention.variants import parse_options

    assert parse_options("affine", {"frozen_alpha": None, "momentum": 0.8}).momentum == 0.8
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['frozen_alpha'\]"):
        parse_options("affine", {"frozen_alpha": 0.5})
