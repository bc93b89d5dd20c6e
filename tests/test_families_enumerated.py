"""Every decoder family transformers ships, enumerated from transformers itself (hf/family_survey.py): each family of
the table exact under conversion (left and right padding, sliding windows, packed documents, the retrofit, cached
decoding), every other candidate refused with its recorded reason, and every reason shown true by forcing a family of
it through the seam. docs/families.md and `affine-attention families --all` are generated from the same records."""
from __future__ import annotations

import functools
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch
import transformers
from test_hf_common import VOCAB  # noqa: F401  (skips without transformers, registers the model types)

import affine_attention
from affine_attention.hf import family_survey as survey
from affine_attention.hf.attention import ATTN_IMPLEMENTATION, LAYER_WINDOW_ATTR, X_KWARG, attention_forward
from affine_attention.hf.families import FAMILIES, family_names, masked_window
from affine_attention.hf.families_refused import (
    ABSENT_IN_LOWEST, ALIASES, LOWEST, NEWEST, REFUSED, newer_than_records,
)
from affine_attention.hf.family_docs import families_markdown
from affine_attention.hf.layers import attention_layers
from affine_attention.variants import get_variant, variant_names

CANDIDATES = {c.model_type: c for c in survey.candidates()}
TABLE = {f.model_type: f for f in FAMILIES.values()}
# The families the per-family test files (tests/test_hf_*.py) already check in depth run here only in the full cross.
EXACT = [pytest.param(t, id=t, marks=() if not f.core else (pytest.mark.exhaustive,)) for t, f in TABLE.items()]
EXACT += [pytest.param(t, id=t) for t in sorted(ALIASES)]


@functools.lru_cache(maxsize=None)
def _verdict(model_type: str) -> survey.Verdict:
    """One check per family and test process (several tests read the same verdict)."""
    return survey.check(_candidate(model_type))


def _candidate(model_type: str) -> survey.Candidate:
    if model_type not in CANDIDATES:
        pytest.skip(f"transformers {transformers.__version__} does not ship {model_type!r} (reported, not an error)")
    return CANDIDATES[model_type]


def test_the_candidates_come_from_transformers_and_every_one_is_recorded():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert set(CANDIDATES) <= set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    # Mamba runs its own selective-scan code and no attention function: not a candidate.
    assert "llama" in CANDIDATES and "mamba" in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and "mamba" not in CANDIDATES
    recorded = set(TABLE) | set(ALIASES) | set(REFUSED)
    assert not set(TABLE) & set(REFUSED) and not set(ALIASES) & (set(TABLE) | set(REFUSED))
    unrecorded = sorted(set(CANDIDATES) - recorded)
    # On a transformers newer than the records, a new family is reported (test_families_newer_than_the_records),
    # refused by convert with the survey command; on the recorded one it means the records are incomplete.
    assert not unrecorded or newer_than_records(transformers.__version__), (
        f"transformers {transformers.__version__} ships candidate families with no verdict: {unrecorded}; run "
        "`affine-attention families --survey` and record them")
    absent = set(recorded) - set(CANDIDATES)
    if transformers.__version__.startswith(LOWEST):
        assert absent == set(ABSENT_IN_LOWEST)
    for model_type in absent:  # a family of a newer transformers: its classes are simply not there
        assert model_type not in TABLE or not TABLE[model_type].available()


@pytest.mark.parametrize("model_type", EXACT)
def test_every_table_family_converts_exactly(model_type):
    verdict = _verdict(model_type)
    assert verdict.exact, f"{model_type}: {verdict.reason}: {verdict.detail} {verdict.deltas}"
    assert set(verdict.deltas) == set(survey.CHECKS) | {"packed_eager"}


def test_an_alias_converts_saves_and_loads_as_its_family(tmp_path):
    alias = sorted(ALIASES)[0]
    model = survey.tiny_model(_candidate(alias))
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
    affine_attention.convert(model, "softmax")
    assert model.config.model_type == f"affine_{ALIASES[alias]}"
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_every_other_candidate_is_refused_for_its_recorded_reason(model_type):
    verdict = _verdict(model_type)
    assert verdict.reason == REFUSED[model_type][0], f"{model_type}: {verdict.reason}: {verdict.detail}"


def test_families_newer_than_the_records_are_reported_not_failed():
    """Issue 44: a user's suite on a transformers released after the records must not fail for the families it adds;
    they are named here (a skip, in the summary with -rs) and refused by convert (next test)."""
    recorded = set(TABLE) | set(ALIASES) | set(REFUSED)
    unrecorded = sorted(set(CANDIDATES) - recorded)
    if unrecorded:
        pytest.skip(f"transformers {transformers.__version__} (newer than the records' {NEWEST}) ships families with "
                    f"no verdict, refused by convert until surveyed (`affine-attention families --survey`): "
                    f"{unrecorded}")
    assert newer_than_records("5.26.0") and newer_than_records("6.0") and not newer_than_records(NEWEST + ".3")
    assert not newer_than_records(LOWEST + ".0")


def test_convert_refuses_a_family_the_records_do_not_know_naming_the_survey(monkeypatch):
    """As on a transformers newer than the records: take one recorded family's record away; convert then says the
    family has no verdict and names the survey command (it said 'not a supported family' before)."""
    from affine_attention.hf import families_refused

    model = survey.tiny_model(_candidate("qwen3_next"))
    monkeypatch.delitem(families_refused.REFUSED, "qwen3_next")
    with pytest.raises(ValueError, match=r"qwen3_next family has no verdict.*affine-attention families --survey"):
        affine_attention.convert(model, "affine")


def test_convert_names_the_family_and_its_reason():
    model = survey.tiny_model(_candidate("qwen3_next"))
    with pytest.raises(ValueError, match=r"qwen3_next.*linear-attention or state-space layers"):
        affine_attention.convert(model, "affine")


# --- every reason is true: what breaks when a family of it is converted anyway -------------------------------------
# (model type, config overrides where its config takes other size keys, what breaks)
FORCED = {
    "encoder_decoder": ("bart", dict(d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128,
                                     encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=128,
                                     vocab_size=128, max_position_embeddings=64),
                        "BartDecoderWrapper' object has no attribute 'layers'"),
    "cross_attention": ("bert", dict(vocab_size=128), "BertLMHeadModel' object has no attribute 'model'"),
    # queries and keys carry a RoPE part the values lack: the seam's one head size does not describe them
    "latent_attention": ("deepseek_v3", {}, "must match the size of tensor"),
    "linear_or_state_space": ("qwen3_next", {}, "has no attribute 'self_attn'"),
    "layout": ("phi", {}, "has no attribute 'o_proj'"),
    "seam": ("minimax_m3_vl_text", {}, r"passes \['block_indices'\]"),
    # the decoder layers sit in the wrapped text model (model.language_model.layers), beside a vision tower
    "multimodal": ("gemma3", dict(text_config=dict(FAMILIES["gemma3"].tiny), mm_tokens_per_image=4,
                                  vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                     num_attention_heads=2, image_size=28, patch_size=14)),
                   "'Gemma3Model' object has no attribute 'layers'"),
}


@pytest.mark.parametrize("reason", sorted(FORCED))
def test_a_structural_refusal_is_true_forced_through_the_seam_it_breaks(reason):
    model_type, overrides, breaks = FORCED[reason]
    assert REFUSED[model_type][0] == reason
    verdict = survey.check(_candidate(model_type), force=True, **overrides)
    assert not verdict.exact and verdict.reason == "seam", (verdict.reason, verdict.detail, verdict.deltas)
    assert re.search(breaks, verdict.detail), verdict.detail


@pytest.mark.parametrize("model_type", ["nemotron", "stablelm"])
def test_a_decoder_that_drops_kwargs_keeps_packed_documents_apart(model_type):
    # Their decoder layers call self_attn with named arguments only: the seam's per-forward context (packed
    # documents, padding) reaches the attention call through attention_mask, which every decoder forwards.
    model_class = getattr(transformers, _candidate(model_type).model_class)
    layer = getattr(sys.modules[model_class.__module__], model_class.__name__.replace("ForCausalLM", "DecoderLayer"))
    call = inspect.getsource(layer.forward).split("self.self_attn(")[1].split(")")[0]
    assert "**kwargs" not in call
    verdict = _verdict(model_type)
    assert verdict.packing_in_transformers and verdict.deltas["packed"] <= survey.TOL, verdict.deltas
    assert verdict.exact, (verdict.reason, verdict.detail)


@pytest.mark.parametrize("model_type, windows", [("phimoe", [4, 4]), ("qwen2_moe", [4, None])])
def test_a_window_the_decoder_masks_but_does_not_pass_is_the_converted_layers_window(model_type, windows):
    # Their attention calls the attention function without sliding_window; eager attention reads only the mask, which
    # their decoder builds with config.sliding_window (PhiMoE: every layer; Qwen2-MoE: layer_types' sliding layers).
    model_class = getattr(transformers, TABLE[model_type].model_class)
    attention = getattr(sys.modules[model_class.__module__], model_class.__name__.replace("ForCausalLM", "Attention"))
    assert "sliding_window=" not in inspect.getsource(attention.forward)
    candidate = _candidate(model_type)
    base = survey.tiny_model(candidate)
    soft = survey.converted(base, candidate, "softmax")
    layers = attention_layers(soft)
    assert [masked_window(getattr(a, LAYER_WINDOW_ATTR), soft.config, a.layer_idx) for a in layers] == windows
    base.set_attn_implementation("eager")  # the reference: transformers' eager attention
    ids, mask, pos = survey._padded(True)
    with torch.no_grad():
        want = base(ids, attention_mask=mask, position_ids=pos).logits
        assert survey._gap(soft(ids, attention_mask=mask, position_ids=pos).logits, want, mask.bool()) <= survey.TOL
        for a in layers:  # the conversion before: these layers ran without a window
            setattr(a, LAYER_WINDOW_ATTR, None)
        assert survey._gap(soft(ids, attention_mask=mask, position_ids=pos).logits, want, mask.bool()) > 0.01
    # a window passed beside the masked one must be that one
    q = torch.randn(1, 4, 3, 16)
    kv = torch.randn(1, 2, 3, 16)
    setattr(layers[0], LAYER_WINDOW_ATTR, TABLE[model_type].mask_window)
    with pytest.raises(ValueError, match="passes sliding_window=8, but its decoder masks a window of 4"):
        attention_forward(layers[0], q, kv, kv, None, sliding_window=8, **{X_KWARG: torch.randn(1, 3, 64)})


@pytest.mark.parametrize("model_type", ["phimoe", "qwen2_moe"])
def test_a_window_the_decoder_masks_is_read_from_the_config_at_call_time(model_type):
    # The decoder builds its mask from config.sliding_window on every forward; the converted layer reads the same
    # config then, so an edit after conversion reaches both (a copy taken at conversion once kept the old window).
    candidate = _candidate(model_type)
    base = survey.tiny_model(candidate)
    soft = survey.converted(base, candidate, "softmax")
    base.set_attn_implementation("eager")
    ids, mask, pos = survey._padded(True)
    for window in (2, 8):
        base.config.sliding_window = soft.config.sliding_window = window
        with torch.no_grad():
            want = base(ids, attention_mask=mask, position_ids=pos).logits
            got = soft(ids, attention_mask=mask, position_ids=pos).logits
        assert survey._gap(got, want, mask.bool()) <= survey.TOL, window


def test_zayas_convolutions_carry_across_packed_documents_in_eager_and_converted_alike():
    # Its q, k and v come from short convolutions over neighbouring tokens before attention: packed documents are not
    # kept apart by transformers' eager model, nor (the same computation) by the converted one.
    candidate = _candidate("zaya")
    base = survey.tiny_model(candidate)
    assert any(isinstance(m, torch.nn.Conv1d) for m in base.model.layers[0].self_attn.qkv_proj.modules())
    soft = survey.converted(base, candidate, "softmax")
    base.set_attn_implementation("eager")
    lens = (5, 4, 6)
    ids = torch.randint(3, 128, (1, sum(lens)), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        eager = base(ids, position_ids=pos, use_cache=False).logits
        alone = torch.cat([base(part, use_cache=False).logits for part in ids.split(lens, dim=1)], 1)
        packed = soft(ids, position_ids=pos, use_cache=False).logits
    assert survey._gap(packed, eager) <= survey.TOL and survey._gap(eager, alone) > 0.01


def test_a_multimodal_models_encoders_would_run_the_seam_without_a_variant():
    # Phi-4-multimodal's causal LM holds its vision and audio encoders: converted anyway, their attention modules
    # run under the seam's implementation name and hold no variant.
    model_type = "phi4_multimodal"
    assert REFUSED[model_type][0] == "multimodal"
    candidate = _candidate(model_type)
    model = survey.converted(survey.tiny_model(candidate), candidate, "softmax")
    vision = model.model.embed_tokens_extend.image_embed.img_processor.encoder.layers[0].self_attn
    assert vision.config._attn_implementation == ATTN_IMPLEMENTATION and not hasattr(vision, "attn_variant")
    with pytest.raises(ValueError, match="has no attention variant"):
        vision(torch.randn(1, 4, vision.config.hidden_size))


def test_a_norm_before_the_output_projection_breaks_the_retrofit():
    model_type = "bitnet"
    assert REFUSED[model_type][0] == "not_exact"
    base = survey.tiny_model(_candidate(model_type))
    assert hasattr(base.model.layers[0].self_attn, "attn_sub_norm")  # RMSNorm undoes the folded 1 / c in o_proj
    deltas = _verdict(model_type).deltas
    assert deltas["retrofit"] > 0.1 and all(deltas[k] <= survey.TOL for k in ("left", "right", "cache"))


@pytest.mark.parametrize("family", [f for f in family_names() if FAMILIES[f].available()])
def test_train_gives_every_rope_layer_the_configured_theta(family):
    """A config class that keeps RoPE per layer type reads a flat dict as one more key beside its defaults (5.25) or
    refuses it (5.17): the model's rope_theta must reach every layer type the config has RoPE for."""
    from affine_attention.train.config import ModelConfig
    from affine_attention.train.model import hf_config

    rope = hf_config(ModelConfig(arch=family, rope_theta=1234.0), eos_token_id=2, pad_token_id=0).rope_parameters
    if not rope:
        return  # no RoPE at all
    per_type = {k: v for k, v in rope.items() if k in ("sliding_attention", "full_attention")}
    for kind, params in (per_type or {"all": rope}).items():
        assert params is None or params["rope_theta"] == 1234.0, (family, kind, rope)


# --- training from scratch: each family's own config keys ----------------------------------------------------------
@pytest.mark.parametrize("family", [f for f in family_names() if FAMILIES[f].available()])
def test_train_writes_every_value_under_the_familys_own_config_key(family):
    from affine_attention.train.config import ModelConfig
    from affine_attention.train.model import hf_config

    f = FAMILIES[family]
    defaults = f.classes()[0]().to_dict()
    eps_key = f.config_keys.get("rms_norm_eps", "rms_norm_eps")
    eps = {} if eps_key is None else {"rms_norm_eps": 1e-3}
    config = hf_config(ModelConfig(arch=family, intermediate_size=40, **eps), eos_token_id=2, pad_token_id=0)
    written = {k for k, v in config.to_dict().items() if k not in defaults}
    # head_dim: hidden_size // num_heads, what a config without the key computes itself
    assert not written - {"head_dim"}, f"{family}: keys its config class does not know: {sorted(written)}"
    width = getattr(config, f.config_keys.get("intermediate_size", "intermediate_size"))
    assert width in (40, [40] * config.num_hidden_layers)  # Gemma 3n's config holds it per layer
    if eps_key is not None:
        assert getattr(config, eps_key) == 1e-3
    for key, target in f.config_keys.items():
        assert target is None or target in defaults, f"{family}: {target} is not a key of {f.config_class}"


def test_a_family_without_the_setting_refuses_it_and_a_renamed_key_would_be_lost():
    from affine_attention.train.config import ModelConfig
    from affine_attention.train.model import hf_config

    renamed = [f for f in FAMILIES.values() if f.available() and f.config_keys.get("rms_norm_eps")]
    f = renamed[0]
    config_cls = f.classes()[0]
    # What the key map prevents: the family's config class takes `rms_norm_eps` without a word and ignores it.
    assert getattr(config_cls(rms_norm_eps=1e-3), f.config_keys["rms_norm_eps"]) != 1e-3
    missing = [f for f in FAMILIES.values() if f.available() and "rms_norm_eps" in f.config_keys
               and f.config_keys["rms_norm_eps"] is None]
    with pytest.raises(ValueError, match=f"the {missing[0].name} architecture has no `rms_norm_eps` setting"):
        hf_config(ModelConfig(arch=missing[0].name, rms_norm_eps=1e-3), eos_token_id=2, pad_token_id=0)


# --- variants pairwise over the enumerated families ----------------------------------------------------------------
PRESERVABLE = [v for v in variant_names() if v != "off_by_one"]
ENUMERATED = [f for f in family_names() if not FAMILIES[f].core]


def _pairs():
    """Each preservable variant on three enumerated families (rotating), the rest of the cross `exhaustive`."""
    chosen, i = set(), 0
    for v in PRESERVABLE:
        picked = 0
        while picked < 3:
            f = ENUMERATED[i % len(ENUMERATED)]
            i += 1
            if not (FAMILIES[f].native_sinks and get_variant(v).refuses_model_sinks):
                chosen.add((f, v))
                picked += 1
    return [pytest.param(f, v, id=f"{f}-{v}", marks=() if (f, v) in chosen else (pytest.mark.exhaustive,))
            for f in ENUMERATED for v in PRESERVABLE
            if not (FAMILIES[f].native_sinks and get_variant(v).refuses_model_sinks)]


@pytest.mark.parametrize("family, variant", _pairs())
def test_every_variant_retrofits_enumerated_families_exactly(family, variant):
    f = FAMILIES[family]
    candidate = _candidate(f.model_type)
    base = survey.tiny_model(candidate)
    base.set_attn_implementation("eager")
    model = survey.converted(base, candidate, variant, function_preserving=True)
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=survey.TOL)


def test_the_docs_show_the_current_records():
    text = (Path(__file__).parents[1] / "docs" / "families.md").read_text()
    assert text == families_markdown(), "regenerate it: affine-attention families --all > docs/families.md"
