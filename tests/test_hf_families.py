"""The family table (hf/families.py) drives everything family-specific, and each family's seam keeps what its
attention computes: Gemma 2's logit cap in every variant, GPT-OSS's own sinks, PEFT targets (Phi-3's fused qkv_proj),
the from-scratch build of `train`, the refusals and the families table. The per-family conversion, retrofit, save /
load / generate and packing tests read the same table (test_hf_common.FAMILIES)."""
from __future__ import annotations

import copy

import pytest
import torch
from test_hf_common import FAMILIES, left_padded, perturb, richest, tiny
from transformers import AutoConfig

import affine_attention
from affine_attention.cli import main
from affine_attention.hf import models
from affine_attention.hf.attention import attention_forward
from affine_attention.hf.cli import families_table
from affine_attention.hf.families import FAMILIES as TABLE
from affine_attention.hf.families import refusal
from affine_attention.hf.presets import PRESETS
from affine_attention.ops import softmax_attention
from affine_attention.train.config import ModelConfig
from affine_attention.train.model import hf_config
from affine_attention.variants import AttentionShape, build_variant, get_variant, variant_names

SINK_FAMILIES = [f for f in FAMILIES if TABLE[f].native_sinks]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_table_gives_each_family_its_preset_converted_classes_and_registration(family):
    f = TABLE[family]
    assert PRESETS[f"tiny-{family}"]["model_type"] == f.model_type
    model = tiny(family)
    assert type(model).__name__ == f.model_class and models.family_of(model) == family
    config_cls, model_cls = models.affine_classes(family)
    assert AutoConfig.for_model(f"affine_{family}").__class__ is config_cls
    assert issubclass(model_cls, f.classes()[1]) and getattr(models, model_cls.__name__) is model_cls


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_targets_follow_the_family(family):
    peft = pytest.importorskip("peft")
    from affine_attention.hf.peft import peft_config

    model = tiny(family, richest(family))
    wrapped = peft.get_peft_model(model, peft_config(model, r=2))
    lora = [n for n, m in wrapped.named_modules() if hasattr(m, "lora_A") and isinstance(m.lora_A, torch.nn.ModuleDict)]
    layers = model.config.num_hidden_layers
    targets = TABLE[family].peft_targets
    assert sorted(n.rsplit(".", 1)[-1] for n in lora) == sorted(list(targets) * layers), lora
    assert not [n for n in lora if ".attn_variant." in n]
    saved = [n for n, m in wrapped.named_modules() if type(m).__name__ == "ModulesToSaveWrapper"]
    assert len(saved) == layers and all(n.endswith("attn_variant") for n in saved)
    ids = torch.randint(3, 128, (2, 9))
    wrapped.train()
    wrapped(input_ids=ids, labels=ids).loss.backward()
    trained = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert trained and all(wrapped.get_parameter(n).grad is not None for n in trained)
    assert any(".attn_variant." in n for n in trained)


def test_an_attention_keyword_the_seam_does_not_implement_is_refused_naming_it_and_the_family():
    model = tiny("gemma2", "softmax")
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match=r"gemma2 attention \(Gemma2Attention\) passes \['logit_bias'\]"):
        attention_forward(attn, q, k, v, None, scaling=0.25, softcap=1.0, logit_bias=torch.zeros(3))


def _inputs(B=2, Hq=4, Hkv=2, T=7, D=8, hidden=12):
    gen = torch.Generator().manual_seed(3)
    q = (2 * torch.randn(B, Hq, T, D, generator=gen, dtype=torch.float64)).requires_grad_()
    k = (2 * torch.randn(B, Hkv, T, D, generator=gen, dtype=torch.float64)).requires_grad_()
    v = torch.randn(B, Hkv, T, D, generator=gen, dtype=torch.float64).requires_grad_()
    x = torch.randn(B, T, hidden, generator=gen, dtype=torch.float64)
    return q, k, v, x


@pytest.mark.parametrize("variant", variant_names())
@pytest.mark.parametrize("mask", ["causal", "padding", "window"])
def test_every_variant_caps_logits_exactly_on_outputs_and_every_gradient(variant, mask):
    """Gemma 2's softcap in float64 against the readable reference: GQA, T = 7, left padding or a 3-key window."""
    module = build_variant(variant, AttentionShape(12, 4, 2, 8)).double()
    perturb(module)
    q, k, v, x = _inputs()
    keys = torch.ones(2, 7, dtype=torch.bool)
    keys[1, :2] = False
    kw = {"causal": dict(is_causal=True), "window": dict(is_causal=True, window=3),
          "padding": dict(is_causal=True, attn_mask=keys[:, None, None, :])}[mask]
    params = [p for p in module.parameters()]
    fast = module(q, k, v, x, softcap=0.7, **kw)
    ref, _, _ = module.reference(q, k, v, x, softcap=0.7, **kw)
    real = keys[:, None, :, None] if mask == "padding" else torch.ones(1, 1, 7, 1, dtype=torch.bool)
    torch.testing.assert_close(fast * real, ref * real, rtol=0, atol=1e-12)
    grad = torch.randn_like(fast) * real
    got = torch.autograd.grad(fast, [q, k, v, *params], grad)
    want = torch.autograd.grad(ref, [q, k, v, *params], grad)
    for name, a, b in zip(["q", "k", "v", *[n for n, _ in module.named_parameters()]], got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=lambda m: f"d{name}: {m}")
    uncapped = module(q, k, v, x, **kw)
    assert (uncapped - fast).abs().max() > 1e-2  # the cap changes what is computed here


@pytest.mark.parametrize("backend", ["sdpa", "cpu_flash"])
def test_a_backend_that_cannot_cap_refuses_a_capped_call(backend):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="no logit soft-capping"):
        softmax_attention(q, k, v, is_causal=True, enable_gqa=True, softcap=1.0, backend=backend)


@pytest.mark.parametrize("family", SINK_FAMILIES)
def test_the_sink_variant_makes_the_models_own_sinks_its_parameters(family):
    base = tiny(family)  # float32: GPT-OSS's grouped expert matmul has no float64
    with torch.no_grad():
        for layer in base.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, layer.self_attn.sinks.numel()))
    base.set_attn_implementation("eager")
    names = dict(base.named_parameters()).keys()
    model = affine_attention.convert(copy.deepcopy(base), "sink")
    assert dict(model.named_parameters()).keys() == names  # no second set of sinks beside the model's
    ids, mask, pos = left_padded(T=12)
    want = base(ids, attention_mask=mask, position_ids=pos).logits
    got = model(ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=0, atol=1e-5)
    want[mask.bool()].square().sum().backward()
    got[mask.bool()].square().sum().backward()
    for (name, a), (_, b) in zip(base.named_parameters(), model.named_parameters()):
        if name.endswith(".sinks"):
            assert a.grad.abs().max() > 0
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", SINK_FAMILIES)
def test_variants_that_cannot_keep_a_models_sinks_refuse_before_anything_changes(family):
    refused = [v for v in variant_names() if refusal(family, v)]
    assert refused and refused == [v for v in variant_names() if get_variant(v).refuses_model_sinks]
    for variant in refused:
        model = tiny(family)
        before = {n: p.clone() for n, p in model.state_dict().items()}
        with pytest.raises(ValueError, match=f"cannot convert a {family} model to '{variant}'"):
            affine_attention.convert(model, variant)
        assert type(model).__name__ == TABLE[family].model_class and not hasattr(model.config, "affine_attention")
        assert not any(hasattr(layer.self_attn, "attn_variant") for layer in model.model.layers)
        assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


@pytest.mark.parametrize("family", SINK_FAMILIES)
def test_a_models_sinks_reach_the_diagnostics_and_survive_save_and_load(family, tmp_path):
    from affine_attention.analysis.capture import AttentionRecorder

    base = tiny(family)
    with torch.no_grad():
        for layer in base.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, layer.self_attn.sinks.numel()))
    base.set_attn_implementation("eager")
    ids = torch.randint(3, 128, (2, 10))
    with torch.no_grad():
        eager = base(ids, output_attentions=True).attentions  # weights over real keys, the sink's share dropped
    model = affine_attention.convert(copy.deepcopy(base), "sink")
    with AttentionRecorder(model) as rec, torch.no_grad():
        model(ids, use_cache=False)
    for record, w in zip(rec.results(), eager):
        want = (1 - w.double().sum(-1)).mean((0, 2))  # (H,) mean sink mass over the queries
        torch.testing.assert_close(record.sink_mass, want, rtol=0, atol=1e-5)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_train_builds_every_family_from_its_model_table(family):
    mc = ModelConfig(arch=family, vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                     num_kv_heads=2, max_position_embeddings=64)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config(mc, eos_token_id=2, pad_token_id=0))
    assert type(model).__name__ == TABLE[family].model_class
    attn = model.model.layers[0].self_attn
    assert attn.head_dim == 8 and model.config.num_key_value_heads == 2
    affine_attention.convert(model, richest(family))
    ids = torch.randint(3, 96, (2, 7))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if ".attn_variant." in n)
    if not TABLE[family].configurable_bias:
        with pytest.raises(ValueError, match="fixes its projection biases"):
            hf_config(ModelConfig(arch=family, attention_bias=True))


def test_an_unknown_arch_names_the_supported_families():
    from affine_attention.train.config_load import config_from_dict

    with pytest.raises(ValueError, match="model.arch = 'gpt2' is not a supported family.*gemma2"):
        config_from_dict({"model": {"arch": "gpt2"}})


def test_the_families_command_and_the_readme_print_the_table(capsys):
    from pathlib import Path

    assert main(["families"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == families_table()
    for family in FAMILIES:
        assert f"| {family} (" in printed
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert families_table() in readme, "README's family table is stale: paste `affine-attention families` into it"
