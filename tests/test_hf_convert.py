"""convert(): exact softmax equivalence, names, masks kept structured, sliding windows, training, errors."""
from __future__ import annotations

import copy

import pytest
import torch
from test_hf_common import FAMILIES, capped, left_padded, perturb, tiny
from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel, LlamaForCausalLM
from transformers.masking_utils import sliding_window_causal_mask_function

import affine_attention
from affine_attention.hf.attention import ATTN_IMPLEMENTATION, X_KWARG, attention_forward, structured_mask
from affine_attention.hf.presets import build_model
from affine_attention.variants import AttentionShape, build_variant, variant_names
from affine_attention.variants.base import ForwardArgs


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_conversion_keeps_logits(family, implementation):
    """Against transformers' own attention (eager and sdpa), with left and right padding; the tiny presets of the
    families with sliding windows use a 4-token window, shorter than these 12 tokens."""
    base = tiny(family)
    if implementation == "sdpa" and (capped(base) or not type(base)._supports_sdpa):
        pytest.skip(f"transformers' sdpa does not compute {family} exactly (it cannot cap logits, or has no sdpa)")
    base.set_attn_implementation(implementation)
    ids, mask, pos = left_padded(T=12)
    right = mask.flip(-1)  # right padding, default positions
    with torch.no_grad():
        ref = base(ids, attention_mask=mask, position_ids=pos).logits
        ref_right = base(ids, attention_mask=right).logits
        ref_nopad = base(ids).logits
    model = affine_attention.convert(copy.deepcopy(base), "softmax")
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=pos).logits
        out_right = model(ids, attention_mask=right).logits
        out_nopad = model(ids).logits
    assert (out - ref)[mask.bool()].abs().max() <= 1e-5
    assert (out_right - ref_right)[right.bool()].abs().max() <= 1e-5
    assert (out_nopad - ref_nopad).abs().max() <= 1e-5


def test_names_config_and_class():
    base = tiny("llama")
    before = dict(base.named_parameters())
    cfg = base.config
    model = affine_attention.convert(base, "affine_gated", activation="sigmoid")
    after = dict(model.named_parameters())
    assert set(before) <= set(after) and all(after[k] is before[k] for k in before)
    new = sorted(set(after) - set(before))
    assert new == sorted(f"model.layers.{i}.self_attn.attn_variant.{n}.weight"
                         for i in range(2) for n in ("alpha_proj", "gate_proj"))
    assert "model.layers.0.self_attn.attn_variant.alpha_ma" in model.state_dict()
    spec = model.config.affine_attention
    assert spec["variant"] == "affine_gated" and spec["options"]["activation"] == "sigmoid"
    assert type(model).__name__ == "AffineLlamaForCausalLM" and model.config.model_type == "affine_llama"
    assert model.config._attn_implementation == "affine_attention"
    assert not hasattr(cfg, "affine_attention") and type(cfg).__name__ == "LlamaConfig"  # caller's config untouched


def test_conversion_errors():
    model = tiny("llama", "affine")
    with pytest.raises(ValueError, match="already converted"):
        affine_attention.convert(model, "affine")
    with pytest.raises(ValueError, match="only the 'affine_attention' implementation"):
        model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="unknown attention variant"):
        affine_attention.convert(tiny("llama"), "nope")
    with pytest.raises(ValueError, match="unknown option"):
        affine_attention.convert(tiny("llama"), "affine", rho=0.5)
    with pytest.raises(ValueError, match="cannot convert LlamaModel"):
        affine_attention.convert(tiny("llama").model, "affine")
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="cannot convert GPT2LMHeadModel"):
        affine_attention.convert(gpt2, "affine")
    with pytest.raises(ValueError, match="attention dropout"):
        affine_attention.convert(tiny("llama", attention_dropout=0.1), "affine")


def _record_masks(model, objects=None):
    """Collect (key mask shape or None, causal, dense mask or None) of the MaskSpec of every variant call (and the
    MaskSpec objects themselves in `objects`)."""
    seen = []

    def hook(mod, a, kw):
        m = ForwardArgs.of(a, kw).call.mask
        seen.append((None if m.keys is None else tuple(m.keys.shape), m.causal, m.dense))
        if objects is not None:
            objects.append(m)
    for m in model.modules():
        if m.__class__.__module__.startswith("affine_attention.variants"):
            m.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def test_masks_stay_structured_and_are_parsed_once_per_forward():
    """The seam hands every layer one parsed mask per forward (its checks and what kernels derive from it run once),
    structured: causal, plus a key mask under padding, never a dense (T, S) mask."""
    model = tiny("llama", "affine")
    objects = []
    seen = _record_masks(model, objects)
    ids, mask, pos = left_padded(T=10)
    with torch.no_grad():
        model(ids)  # no padding: plain causal
        model(ids, attention_mask=mask, position_ids=pos)  # left padding: key mask + causal
        right = mask.flip(-1)
        model(ids, attention_mask=right)  # right padding: key mask + causal
    assert seen[:2] == [(None, True, None)] * 2
    assert seen[2:] == [((3, 1, 1, 10), True, None)] * 4
    assert [len({id(m) for m in objects[i:i + 2]}) for i in (0, 2, 4)] == [1, 1, 1]  # 2 layers, one object
    assert len({id(m) for m in objects}) == 3


def test_mask_function_forms():
    pad = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert structured_mask(2, 4, 4, attention_mask=torch.ones(2, 4, dtype=torch.bool)) is None
    assert torch.equal(structured_mask(2, 4, 4, attention_mask=pad).keys, pad[:, None, None, :])
    # a sliding window stays structured (the attention function passes it on as `window=`): padding only
    assert structured_mask(2, 4, 4, attention_mask=pad, local_size=4).keys.shape == (2, 1, 1, 4)
    assert structured_mask(1, 6, 6, local_size=4, mask_function=sliding_window_causal_mask_function(4)) is None
    # any other pattern (here a window without local_size, as a custom mask function) is dense, transformers' own
    dense = structured_mask(1, 6, 6, mask_function=sliding_window_causal_mask_function(4))
    i, j = torch.arange(6)[:, None], torch.arange(6)[None]
    assert torch.equal(dense[0, 0], (j <= i) & (j > i - 4))
    # not bottom-right aligned (a static cache of 8 slots, 2 written): dense
    static = structured_mask(1, 1, 8, q_offset=2, attention_mask=torch.ones(1, 3, dtype=torch.bool))
    assert torch.equal(static[0, 0, 0], torch.arange(8) <= 2)


def _reference_forward(module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kwargs):
    """Independent reference: the variant's eager form under a window mask built here from positions."""
    T, S = query.shape[-2], key.shape[-2]
    i = torch.arange(T)[:, None] + (S - T)
    j = torch.arange(S)[None]
    vis = j <= i
    if sliding_window is not None:
        vis = vis & (j > i - sliding_window)
    out, _, _ = module.attn_variant.reference(query, key, value, kwargs[X_KWARG], attn_mask=vis[None, None],
                                              scale=scaling)
    return out.transpose(1, 2), None


@pytest.mark.parametrize("variant", ["affine", "sink"])
def test_sliding_window_matches_reference(variant):
    model = tiny("mistral", variant)  # sliding window 4, sequences of 11
    perturb(model)
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        out = model(ids).logits
        # The reference runs in the seam's place (a converted model refuses any other implementation name).
        AttentionInterface.register(ATTN_IMPLEMENTATION, _reference_forward)
        try:
            ref = model(ids).logits
        finally:
            AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    assert (out - ref).abs().max() <= 1e-5


def _adds_parameters(variant: str) -> bool:
    return any(True for _ in build_variant(variant, AttentionShape(8, 2, 1, 4)).parameters())


@pytest.mark.parametrize("variant", [v for v in variant_names() if _adds_parameters(v)])
def test_gradients_reach_every_new_parameter(variant):
    model = tiny("qwen3", variant).train()
    perturb(model)
    ids, mask, pos = left_padded(T=8)
    model(ids, attention_mask=mask, position_ids=pos, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if ".attn_variant." in n}
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
                         for g in grads.values()), grads.keys()


def test_gradient_checkpointing_updates_alpha_ma_once():
    plain = tiny("llama", "affine").train()
    perturb(plain)
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable()
    before = plain.model.layers[0].self_attn.attn_variant.alpha_ma.clone()
    calls = {id(plain): 0, id(checkpointed): 0}
    for m in (plain, checkpointed):
        m.model.layers[0].self_attn.attn_variant.register_forward_hook(
            lambda *_, key=id(m): calls.__setitem__(key, calls[key] + 1))
    ids, mask, pos = left_padded(T=8)
    for m in (plain, checkpointed):
        m(ids, attention_mask=mask, position_ids=pos, labels=ids).loss.backward()
        affine_attention.step_running_stats(m)
    assert calls == {id(plain): 1, id(checkpointed): 2}  # the checkpointed layer really ran again in backward
    for lp, lc in zip(plain.model.layers, checkpointed.model.layers):
        assert torch.equal(lp.self_attn.attn_variant.alpha_ma, lc.self_attn.attn_variant.alpha_ma)
    # exactly one EMA step from the mean alpha over real tokens only (padding excluded)
    attn = plain.model.layers[0].self_attn
    with torch.no_grad():
        x = plain.model.layers[0].input_layernorm(plain.model.embed_tokens(ids))
        alpha = attn.attn_variant.compute_alpha(x)  # (B, H, T)
        w = mask.bool()[:, None, :].float()
        mean = (alpha * w).sum((0, 2)) / w.sum((0, 2))
    assert torch.allclose(attn.attn_variant.alpha_ma, 0.9 * before + 0.1 * mean, atol=1e-6)
    gp = {n: p.grad for n, p in plain.named_parameters()}
    for n, p in checkpointed.named_parameters():
        assert torch.allclose(p.grad, gp[n], atol=1e-6), n


def test_bf16_runs_and_tracks_fp32():
    model32 = tiny("llama", "affine")
    perturb(model32)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    ids, mask, pos = left_padded(T=10)
    with torch.no_grad():
        ref = model32(ids, attention_mask=mask, position_ids=pos).logits
        out = model16(ids, attention_mask=mask, position_ids=pos).logits
        gen = model16.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all() and gen.shape == (3, 13)
    assert (out.float() - ref)[mask.bool()].abs().max() < 0.1


def test_torch_compile_traces_forward_and_backward():
    """Dynamo traces the pre-hook, the attention seam and the variant (aot_eager: no C++ build, fast)."""
    model = tiny("llama", "affine", num_hidden_layers=1).train()
    reference = copy.deepcopy(model)
    ids, mask, pos = left_padded(T=8)
    compiled = torch.compile(model, backend="aot_eager")
    loss = compiled(ids, attention_mask=mask, position_ids=pos, labels=ids).loss
    loss.backward()
    ref = reference(ids, attention_mask=mask, position_ids=pos, labels=ids).loss
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-5)
    ref_grads = dict(reference.named_parameters())
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n].grad, atol=1e-5), n


@pytest.mark.slow
def test_torch_compile_inductor_affine():
    model = tiny("llama", "affine").train()
    reference = copy.deepcopy(model)
    ids, mask, pos = left_padded(T=16)
    loss = torch.compile(model)(ids, attention_mask=mask, position_ids=pos, labels=ids).loss
    loss.backward()
    ref = reference(ids, attention_mask=mask, position_ids=pos, labels=ids).loss
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-5)
    assert all(p.grad is not None for p in model.parameters())
    for m in (model, reference):
        affine_attention.step_running_stats(m)
    for lm, lr in zip(model.model.layers, reference.model.layers):
        assert torch.allclose(lm.self_attn.attn_variant.alpha_ma, lr.self_attn.attn_variant.alpha_ma)


@pytest.mark.parametrize("variant", ["softmax", "affine", "sink"])
def test_converted_model_runs_under_bf16_autocast(variant):
    """RoPE returns float32 q/k under autocast while v is bfloat16: the seam must hand the op one dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1))
    ids = torch.randint(0, 64, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = m(input_ids=ids).logits.float()
    affine_attention.convert(m, variant)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(input_ids=ids).logits.float()
        out.sum().backward()
    assert torch.isfinite(out).all()
    if variant == "softmax":
        torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05)


class MyLlama(LlamaForCausalLM):
    """A user's subclass with a method of its own (kept after conversion)."""

    def greeting(self):
        return "hello"


def test_convert_accepts_a_subclass_and_saves_a_checkpoint_of_the_family(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = tiny("llama")
    model = MyLlama(ref.config)
    model.load_state_dict(ref.state_dict())
    model.eval()
    for m in (ref, model):
        affine_attention.convert(m, "affine")
    assert isinstance(model, MyLlama) and model.greeting() == "hello"
    assert isinstance(model, type(ref)) and model.config.model_type == "affine_llama"
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    model.save_pretrained(tmp_path)
    assert model.config.auto_map == ref.config.auto_map
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(ref)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ref(input_ids=ids).logits)


@pytest.mark.parametrize("variant", variant_names())
def test_converted_model_runs_on_the_meta_device(variant):
    """Shape inference and FLOP counting run models on meta tensors: a converted model must do what the unconverted
    one does there (forward and backward without data), not fail in its autocast check."""
    model = build_model("tiny-llama", variant, device="meta")
    ids = torch.zeros(2, 7, dtype=torch.long, device="meta")
    logits = model(ids).logits
    logits.sum().backward()
    assert logits.shape == (2, 7, model.config.vocab_size) and logits.device.type == "meta"
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters() if p.requires_grad)


def test_a_subclass_with_a_model_type_of_its_own_converts_as_its_family():
    from transformers import LlamaConfig

    class MyConfig(LlamaConfig):
        model_type = "my_llama"

    ref = tiny("llama")
    model = MyLlama(MyConfig(**{k: v for k, v in ref.config.to_dict().items() if k != "model_type"}))
    assert model.config.model_type == "my_llama"
    model.load_state_dict(ref.state_dict())
    model.eval()
    for m in (ref, model):
        affine_attention.convert(m, "affine_gated")
    assert model.config.model_type == "affine_llama"
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
