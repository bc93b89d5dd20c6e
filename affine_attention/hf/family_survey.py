"""Every decoder family the installed transformers ships, enumerated from transformers itself (its causal-LM mapping,
kept where the modeling code calls its attention interface), each checked exact under conversion or refused with its
reason (the keys of families_refused.REASONS): `affine-attention families --survey` and the enumeration's tests."""
from __future__ import annotations

import copy
import inspect
import re
import sys
from dataclasses import dataclass, field

import torch

# The sizes of a tiny test model, applied to the keys a family's config has (hidden 64, 2 layers, 4 heads of 16,
# 2 KV heads, vocabulary 128, small MoE).
TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 512,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "attention_dropout": 0.0,
    "hidden_dropout": 0.0, "dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
    "use_cache": True,
}
WINDOW = 4
# The keys a tiny model needs beyond TINY, for the candidates outside the family table whose config classes take other
# size keys or do not build from TINY alone (table families keep theirs in Family.tiny).
SIZE_KEYS = {
    # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig does not declare (transformers 5.24)
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=512, attn_config=dict(kv_n_heads=2, rope_theta=1e4),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)),
    "dots3_note_text": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
                            q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, index_n_heads=2,
                            index_head_dim=16, shared_experts_intermediate_size=32),
    # a top-k indexer over compressed keys on its "indexed_attention" layers (the seam refuses that layer type)
    "kolibri1_1": dict(layer_types=["sliding_attention", "indexed_attention"], sliding_window=4, index_num_heads=2,
                       index_topk=4, index_pool_size=16, index_compression=4, index_num_local_tokens=2,
                       index_num_sink_tokens=1, mlp_only_layers=[0], mlp_only_intermediate_size=32,
                       moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       shared_expert_intermediate_size=32),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "phi4_multimodal": dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=28, patch_size=14),
                            audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1,
                                              num_attention_heads=2)),
    "zamba": dict(layers_block_type=["mamba", "hybrid"]),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"]),
}
MAX_TINY_PARAMETERS = 5_000_000  # a family whose config ignores the TINY keys is not built for real
_WINDOW_KINDS = {"full_attention", "sliding_attention"}  # the layer types the seam runs
# Layer types of a family's own naming that are these: ZAYA's CCA layers run under transformers' causal ("hybrid")
# and sliding-window ("hybrid_sliding") masks (modeling_zaya's mask_creation_functions).
_KIND_ALIASES = {"zaya": {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}}


@dataclass(frozen=True)
class Candidate:
    """A causal-LM model type of transformers whose modeling code calls the attention interface."""

    model_type: str
    config_class: str
    model_class: str


def candidates() -> list[Candidate]:
    """Every model type of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES whose modeling module dispatches attention through
    ALL_ATTENTION_FUNCTIONS (the others run their own attention code, which no registered function replaces)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        cls = getattr(transformers, class_name)
        if "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(sys.modules[cls.__module__]):
            out.append(Candidate(model_type, CONFIG_MAPPING_NAMES[model_type], class_name))
    return out


def tiny_config(candidate: Candidate, **overrides):
    """The family's own config class with the TINY sizes on the keys it has; a sliding window of WINDOW where the
    family has one (its layers alternating sliding and full where it lists layer types)."""
    import transformers

    config_cls = getattr(transformers, candidate.config_class)
    defaults = config_cls().to_dict()
    values = {k: v for k, v in TINY.items() if k in defaults}
    if "sliding_window" in defaults:
        values["sliding_window"] = WINDOW
        if "use_sliding_window" in defaults:
            values["use_sliding_window"] = True
            values["max_window_layers"] = 1
        kinds = defaults.get("layer_types")
        if kinds is not None and set(kinds) <= _WINDOW_KINDS:
            values["layer_types"] = ["sliding_attention", "full_attention"]
    values.update(SIZE_KEYS.get(candidate.model_type, {}))
    values.update(overrides)
    return config_cls(**values)


_HYBRID = re.compile(r"Mamba|LinearAtt|DeltaNet|ShortConv|Recurrent|Lightning|SSM|Mlstm|MLSTM|Rglru|Mixer")


def class_refusal(candidate: Candidate) -> tuple[str, str] | None:
    """(reason key, detail) read from the config class alone: encoder-decoder and composite multimodal configs,
    whose defaults need not even build a config."""
    import transformers

    config_cls = getattr(transformers, candidate.config_class)
    subs = sorted(getattr(config_cls, "sub_configs", None) or ())
    if getattr(config_cls, "is_encoder_decoder", False) is True or any("encoder" in s for s in subs):
        return "encoder_decoder", f"{candidate.config_class} ({', '.join(subs) or 'is_encoder_decoder'})"
    if {"text_config", "vision_config", "audio_config"} & set(subs):
        return "multimodal", f"{candidate.config_class} ({', '.join(subs)})"
    return None


def static_refusal(candidate: Candidate, config, meta_model) -> tuple[str, str] | None:
    """(reason key, detail) read from the family's config and its model's modules (built on the meta device), or
    None where nothing in its structure stops a conversion (the checks of `check` decide)."""
    if getattr(config, "is_encoder_decoder", False):
        return "encoder_decoder", f"{candidate.config_class}.is_encoder_decoder"
    if candidate.model_class.endswith("ForConditionalGeneration"):
        return "multimodal", candidate.model_class
    latent = [k for k in ("kv_lora_rank", "q_lora_rank") if getattr(config, k, None)]
    if latent:
        return "latent_attention", f"config.{latent[0]}"
    names = {type(m).__name__ for m in meta_model.modules()}
    cross = sorted(n for n in names if "CrossAttention" in n)
    layers = getattr(getattr(meta_model, "model", None), "layers", None)
    if layers is None and hasattr(meta_model.base_model, "encoder"):
        return "cross_attention", f"{type(meta_model.base_model).__name__}.encoder"
    if cross:
        return "cross_attention", ", ".join(cross)
    hybrid = sorted(n for n in names if _HYBRID.search(n))
    aliases = _KIND_ALIASES.get(candidate.model_type, {})
    kinds = {aliases.get(k, k) for k in getattr(config, "layer_types", None) or ()} - _WINDOW_KINDS
    if hybrid:
        return "linear_or_state_space", ", ".join(hybrid)
    if layers is None:
        return "layout", f"{type(meta_model).__name__} has no model.layers"
    if not all(hasattr(layer, "self_attn") and hasattr(layer.self_attn, "o_proj") for layer in layers):
        return "layout", "a decoder layer without self_attn.o_proj"
    if kinds:
        return "seam", f"layer types {sorted(kinds)}"
    return None


TOL = 1e-5  # float32 logits against transformers' eager attention (which takes its softmax in float32 too)
# The checks of `check`, in the order they run: what each compares.
CHECKS = {
    "left": "softmax conversion vs eager attention, left-padded batch (real tokens)",
    "right": "softmax conversion vs eager attention, right-padded batch (real tokens)",
    "packed": "softmax conversion of three packed documents vs each document alone",
    "retrofit": "function-preserving retrofit vs eager attention, left-padded batch",
    "cache": "cached greedy generation's step logits vs one full forward (perturbed variant state)",
}


@dataclass
class Verdict:
    """One candidate's outcome: `reason` None means exact (every check within TOL)."""

    candidate: Candidate
    reason: str | None = None
    detail: str = ""
    deltas: dict[str, float] = field(default_factory=dict)
    packing_in_transformers: bool | None = None  # whether eager attention itself keeps packed documents apart

    @property
    def exact(self) -> bool:
        return self.reason is None


def family_for(candidate: Candidate, model):
    """The family-table entry of a candidate, or one made for the check (the table's layout, sinks as found)."""
    from .families import FAMILIES, Family

    for f in FAMILIES.values():  # its own entry, or (a model type that runs a table family's class) that family's
        if f.model_type == candidate.model_type or f.model_class == candidate.model_class:
            return f
    return Family(name=candidate.model_type, model_type=candidate.model_type, config_class=candidate.config_class,
                  model_class=candidate.model_class, projections="", attention="", tiny={},
                  native_sinks=hasattr(model.model.layers[0].self_attn, "sinks"))


def converted(model, candidate: Candidate, variant: str, function_preserving: bool = False, **options):
    """A converted copy of `model`: the attention part of `convert`, by the family's layout."""
    from .convert import convert_layers
    from .layers import make_spec

    model = copy.deepcopy(model)
    convert_layers(model, family_for(candidate, model), make_spec(variant, options), function_preserving)
    return model


def _padded(left: bool, T: int = 12, pads=(0, 3, 1)):
    """input_ids, attention_mask, position_ids: (3, T), padded on the left or the right by `pads`."""
    ids = torch.randint(3, TINY["vocab_size"], (len(pads), T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(len(pads), T, dtype=torch.long)
    for b, p in enumerate(pads):
        if p and left:
            mask[b, :p] = 0
        elif p:
            mask[b, T - p:] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _gap(a, b, where=None) -> float:
    return float((a[where] - b[where]).abs().max() if where is not None else (a - b).abs().max())


@torch.no_grad()
def run_checks(base, candidate: Candidate, variant: str) -> dict[str, float]:
    """The CHECKS on a float32 tiny model; `variant` is retrofitted and, with perturbed state, generates."""
    deltas = {}
    eager = copy.deepcopy(base)
    eager.set_attn_implementation("eager")
    soft = converted(base, candidate, "softmax")
    for name, left in (("left", True), ("right", False)):
        ids, mask, pos = _padded(left)
        deltas[name] = _gap(eager(ids, attention_mask=mask, position_ids=pos).logits,
                            soft(ids, attention_mask=mask, position_ids=pos).logits, mask.bool())
    lens = (5, 4, 6)
    ids = torch.randint(3, TINY["vocab_size"], (1, sum(lens)), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    alone = torch.cat([eager(part, use_cache=False).logits for part in ids.split(lens, dim=1)], 1)
    deltas["packed_eager"] = _gap(eager(ids, position_ids=pos, use_cache=False).logits, alone)
    deltas["packed"] = _gap(soft(ids, position_ids=pos, use_cache=False).logits, alone)
    ids, mask, pos = _padded(True)
    kept = converted(base, candidate, variant, function_preserving=True)
    deltas["retrofit"] = _gap(eager(ids, attention_mask=mask, position_ids=pos).logits,
                              kept(ids, attention_mask=mask, position_ids=pos).logits, mask.bool())
    model = converted(base, candidate, variant)
    gen = torch.Generator().manual_seed(2)
    for name, p in model.named_parameters():
        if ".attn_variant." in name:
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("alpha_ma"):
            b.copy_(torch.rand(b.shape, generator=gen))
    model.generation_config.eos_token_id = None
    ids, mask, _ = _padded(True, T=8)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    full_mask = torch.cat([mask, torch.ones(len(mask), 5, dtype=mask.dtype)], 1)
    full = model(out.sequences, attention_mask=full_mask, position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0),
                 use_cache=False).logits[:, ids.shape[1] - 1:-1]
    deltas["cache"] = _gap(full, torch.stack(out.logits, 1))
    return deltas


def richest_variant(native_sinks: bool) -> str:
    """The registered variant with the most kinds of state (mean of V, lse, output gate) that a family with or
    without its own sinks accepts: the one whose retrofit and cached decoding exercise the most of the seam."""
    from ..variants import AttentionVariant, get_variant, variant_names

    def kinds(name: str) -> int:
        cls = get_variant(name)
        return cls.uses_value_mean + cls.needs_lse + (cls.output_gate is not AttentionVariant.output_gate)

    accepted = [v for v in variant_names() if not (native_sinks and get_variant(v).refuses_model_sinks)]
    return max(accepted, key=kinds)


def tiny_model(candidate: Candidate, *, meta: bool = False, **overrides):
    """The candidate's tiny causal LM (float32, eval mode, seed 0), or its meta-device skeleton: a table family's
    own `tiny-<family>` preset, any other candidate's `tiny_config`."""
    from transformers import AutoModelForCausalLM

    from .families import FAMILIES
    from .presets import preset_config

    table = [f.name for f in FAMILIES.values() if f.model_type == candidate.model_type]
    config = preset_config(f"tiny-{table[0]}", **overrides) if table else tiny_config(candidate, **overrides)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float().eval()


def check(candidate: Candidate, *, force: bool = False, **overrides) -> Verdict:
    """Classify one candidate: a structural refusal, else the CHECKS (any failure is the refusal's reason).
    force=True runs the CHECKS past a structural refusal: what breaks when such a family is converted anyway
    (`overrides`: config keys, for a config that takes other size keys)."""
    verdict = Verdict(candidate)
    found = class_refusal(candidate)
    if found and not force:
        verdict.reason, verdict.detail = found
        return verdict
    try:
        meta = tiny_model(candidate, meta=True, **overrides)
        found = found or static_refusal(candidate, meta.config, meta)
        size = sum(p.numel() for p in meta.parameters())
        if size > MAX_TINY_PARAMETERS and (found is None or force):
            found = ("unchecked", f"its config class takes other size keys: the 'tiny' model has {size:,} parameters")
    except Exception as err:  # noqa: BLE001  (any failure to build is the verdict, with its message)
        verdict.reason, verdict.detail = "unchecked", _first_line(err)
        return verdict
    if found and (not force or found[0] == "unchecked"):
        verdict.reason, verdict.detail = found
        return verdict
    try:
        base = tiny_model(candidate, **overrides)
        variant = richest_variant(family_for(candidate, base).native_sinks)
        deltas = verdict.deltas = run_checks(base, candidate, variant)
    except Exception as err:  # noqa: BLE001
        verdict.reason, verdict.detail = "seam", _first_line(err)
        return verdict
    verdict.packing_in_transformers = deltas["packed_eager"] <= TOL
    # Packing is held to transformers only where its eager attention keeps documents apart itself.
    bad = [k for k in CHECKS if deltas[k] > TOL and (k != "packed" or verdict.packing_in_transformers)]
    if bad:
        verdict.reason, verdict.detail = "not_exact", ", ".join(f"{k} {deltas[k]:.2g}" for k in bad)
    return verdict


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
