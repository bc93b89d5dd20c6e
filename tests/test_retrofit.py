"""Function-preserving conversion (a retrofit): same logits as the unconverted model, every new parameter trainable,
the choice recorded in the saved config and kept through save / load / generate."""
from __future__ import annotations

import re

import pytest
import torch
from covering import covering_pairs, split_cross
from test_hf_common import VOCAB, tiny
from transformers import AutoModelForCausalLM

import affine_attention
from affine_attention.variants import can_retrofit, get_variant, variant_names

PRESERVABLE = [v for v in variant_names() if can_retrofit(v)]
# Every family with a preservable variant of each kind, every such variant on >= 3 families (tests/covering.py); the
# rest of the cross is marked `exhaustive`. Refused pairs are tested in test_hf_families.py.
RETROFIT = covering_pairs(variants=PRESERVABLE)
# The sink starts at a logit of -40, a mass of sigmoid(-40 - lse) per row that float32 rounds away: held to the
# conversion's own rounding (2e-6 here; SmolLM2 checks it at 1e-5 with real logit ranges, test_hf_smollm2.py).
TOL = {"sink": 2e-6}


def _ids(seed=0, shape=(2, 13)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family, variant", split_cross(RETROFIT, variants=PRESERVABLE))
def test_logits_kept_and_every_new_parameter_trains(family, variant):
    base = tiny(family)
    ids = _ids()
    with torch.no_grad():
        ref = base(input_ids=ids).logits
    model = affine_attention.convert(tiny(family), variant, function_preserving=True)
    with torch.no_grad():
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=TOL.get(variant, 1e-5))

    new = {n: p.detach().clone() for n, p in model.named_parameters() if ".attn_variant." in n}
    model.train()
    # eps far below the gradients: the retrofit sink's gradient is its mass, sigmoid(-40 - lse), about 1e-21 on the
    # Gemma and Granite presets, whose AdamW step at the default eps (1e-8) rounds away at -40 in float32.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, eps=1e-30)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    for name, p in model.named_parameters():
        if name in new:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name
    opt.step()
    for name, before in new.items():
        after = dict(model.named_parameters())[name]
        assert not torch.equal(after.detach(), before), f"{name} did not change in one training step"


def test_recorded_and_round_trips(tmp_path):
    model = affine_attention.convert(tiny("llama"), "affine_gated", function_preserving=True)
    want = {"function_preserving": True, "weight_scale": 0.5, "o_proj_scale": 4.0}
    assert model.config.affine_attention["retrofit"] == want
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.affine_attention["retrofit"] == want
    ids = _ids(1, (1, 7))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    a = model.generate(ids, max_new_tokens=6, do_sample=False)
    b = loaded.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)
    for name, buf in model.named_buffers():
        if name.endswith("alpha_ma"):
            assert torch.equal(buf, torch.full_like(buf, 0.5)) and torch.equal(dict(loaded.named_buffers())[name], buf)


def test_default_keeps_the_papers_init():
    model = affine_attention.convert(tiny("llama"), "affine")
    assert "retrofit" not in model.config.affine_attention
    assert all(float(b.abs().max()) == 0 for n, b in model.named_buffers() if n.endswith("alpha_ma"))


@pytest.mark.parametrize("variant, options, match", [
    *[(v, {}, re.escape(get_variant(v).retrofit_refusal)) for v in variant_names() if not can_retrofit(v)],
    ("affine_frozen", {"frozen_alpha": 0.0}, "frozen_alpha = 0.0 scales attention to zero"),
    ("scaled_softmax", {"scale": 0.0}, "scale = 0.0 cannot preserve"),
])
def test_refused_before_anything_changes(variant, options, match):
    model = tiny("qwen2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        affine_attention.convert(model, variant, function_preserving=True, **options)
    assert not hasattr(model.model.layers[0].self_attn, "attn_variant")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="function_preserving must be True or False"):
        affine_attention.convert(tiny("qwen2"), "affine", function_preserving="yes")
