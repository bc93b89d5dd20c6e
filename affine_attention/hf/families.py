"""The one table of the transformers model families `convert` supports: per family, its transformers classes, how
its attention modules are laid out and what their attention function receives, its PEFT targets, how `train` builds
it from scratch, and its tiny test preset. Adding a family is one `Family` entry here (nothing else names one).

This module imports no transformers: classes are named, and resolved (`Family.classes`) when a model is converted.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# The keyword rule of the seam (hf/attention.py): every keyword that reaches a model's attention function beyond
# (q, k, v, mask) is either honoured (its meaning implemented, below) or known inert for attention (INERT_KWARGS);
# anything else is refused with a ValueError naming it and the family. What reaches it is whatever the decoder's
# **kwargs carry: transformers' declared forward keywords (TransformersKwargs, FlashAttentionKwargs), the objects
# generate() hands forward through its model_kwargs, and what trainers' collators put in a batch.
# `hf.attention.unclassified_kwargs()` lists the installed transformers' declared keywords that neither table
# classifies (a test keeps it empty), so a new transformers keyword is classified here before a model meets it.
HONOURED_KWARGS = {
    "scaling": "the score scale (query_pre_attn_scalar, attention multipliers)",
    "dropout": "attention dropout, which must be 0",
    "sliding_window": "the layer's sliding window (None on full-attention layers)",
    "softcap": "logit soft-capping c * tanh(x / c), computed in the kernel",
    "s_aux": "the model's learned sink logits, kept under every variant that accepts them",
    "cu_seq_lens_q": "packed documents (varlen)", "cu_seq_lens_k": "packed documents (varlen)",
    "max_length_q": "packed documents (varlen)", "max_length_k": "packed documents (varlen)",
    "seq_idx": "packed documents: each token's document id (trl's padding-free collator)",
    "is_causal": "causal attention (True); bidirectional (False) is refused",
    "output_attentions": "returning attention weights (False); True is refused",
}
# Honoured keywords whose other values the seam does not implement: None or the value named here passes, any other
# value is refused with the reason.
REQUIRED_VALUES = {
    "is_causal": (True, "bidirectional attention (is_causal=False) is not implemented by affine_attention; "
                        "its variants are causal"),
    "output_attentions": (False, "affine_attention's kernels never materialise attention weights; capture them with "
                                 "affine_attention.analysis.capture.AttentionRecorder (or `affine-attention analyze`)"),
}
# Keywords that travel through the decoder's **kwargs and do not enter the attention math, each with why.
INERT_KWARGS = {
    "position_ids": "RoPE was applied to q and k before the call; packing restarts are read by the packing hook",
    "cache_position": "the cache was updated before the call",
    "use_cache": "the cache was updated before the call",
    "position_embeddings": "RoPE was applied to q and k before the call",
    "output_router_logits": "router logits belong to the MoE MLP",
    "output_hidden_states": "hidden states are recorded around the decoder layers",
    "num_items_in_batch": "the Trainer's token count, for the loss",
    # generate() pops these from its own kwargs and passes them on to every forward with the model_kwargs
    "tokenizer": "generate()'s tokenizer (stop_strings, token healing)",
    "assistant_tokenizer": "generate()'s assistant tokenizer (assisted decoding)",
}

def _tiny(**extra) -> dict[str, Any]:
    """A tiny test model (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 128); `extra` adds family keys."""
    return {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 512,
            "tie_word_embeddings": False, **extra}


# Token ids inside the tiny vocabulary, for families whose defaults point past it.
_TINY_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
_TWO_LAYER_TYPES = ["sliding_attention", "full_attention"]


@dataclass(frozen=True)
class Family:
    """One supported transformers family. Every decoder layer is `model.layers[i]`, its attention `.self_attn` (fed
    the pre-normed hidden states, as every family here is), its output projection `.o_proj`."""

    name: str  # this library's name, e.g. "gemma3"
    model_type: str  # transformers' config.model_type, e.g. "gemma3_text"
    config_class: str  # transformers class names, resolved on use
    model_class: str
    projections: str  # how q, k, v are projected (fused or not, biases, q/k norms), for the families table
    attention: str  # what its attention function receives beyond scaling, for the families table
    tiny: Mapping[str, Any]  # the tiny test preset's config keys ("tiny-<name>"), sizes as `_tiny`
    peft_targets: tuple[str, ...] = ("q_proj", "v_proj")  # LoRA's default target modules (PEFT's own for it)
    native_sinks: bool = False  # its attention has learned sink logits (passed as s_aux)
    # train: whether [model].attention_bias maps to the config's `attention_bias` (False: the family fixes its
    # biases, e.g. Qwen2's q/k/v biases); every other [model] key maps to the config's key of the same meaning.
    configurable_bias: bool = True
    # train: the config takes RoPE parameters per layer type ({"sliding_attention": {...}, "full_attention": {...}});
    # [model]'s one rope_theta then serves both.
    rope_per_layer_type: bool = False
    # train: the family's own config key for each key `train` writes (hf_config) that it names differently, e.g.
    # Cohere's {"rms_norm_eps": "layer_norm_eps"}; None: it has no such setting (a [model] value is refused). A config
    # class takes an unknown key without a word, so without this the value would be dropped silently.
    config_keys: Mapping[str, str | None] = field(default_factory=lambda: MappingProxyType({}))
    # Where a layer's sliding window comes from when the family's attention does not pass `sliding_window` to its
    # attention function, though its decoder hands that layer a sliding-window mask (eager attention reads only the
    # mask): "layer_types": config.sliding_window on the layers config.layer_types marks "sliding_attention"
    # (Qwen2-MoE); "every_layer": config.sliding_window on every layer when it is set (PhiMoE). None: the attention
    # passes the window itself.
    mask_window: str | None = None
    # The per-family test files (tests/test_hf_*.py) run it. The others (core=False) share the layout of these and are
    # proven by tests/test_families_enumerated.py alone: conversion, padding, windows, packing, retrofit, decoding.
    core: bool = True

    def classes(self) -> tuple[type, type]:
        """(config class, causal LM class) of transformers."""
        import transformers

        return getattr(transformers, self.config_class), getattr(transformers, self.model_class)

    def layer_window(self, config, layer_idx: int) -> int | None:
        """The sliding window of layer `layer_idx` that the family's decoder masks but does not pass on (see
        `mask_window`), or None."""
        return masked_window(self.mask_window, config, layer_idx)

    def available(self) -> bool:
        """Whether the installed transformers ships this family (the table spans the supported versions; a family
        transformers added later is simply absent from an older one)."""
        import transformers

        return hasattr(transformers, self.model_class) and hasattr(transformers, self.config_class)


def _family(**kw) -> Family:
    kw["tiny"] = MappingProxyType(kw["tiny"])
    kw["config_keys"] = MappingProxyType(kw.get("config_keys", {}))
    return Family(**kw)


def _enumerated(name: str, config_class: str, model_class: str, projections: str, attention: str = "-", *,
                keys: Mapping[str, str | None] | None = None, **kw) -> Family:
    """A family found exact by the enumeration of transformers' decoders (hf/family_survey.py), with the standard
    tiny preset plus `tiny` keys."""
    return _family(name=name, model_type=kw.pop("model_type", name), config_class=config_class,
                   model_class=model_class, projections=projections, attention=attention,
                   tiny=_tiny(head_dim=16, **_TINY_IDS, **kw.pop("tiny", {})), config_keys=keys or {}, core=False,
                   **kw)


_SEPARATE = "q_proj, k_proj, v_proj (no bias)"
FAMILIES: dict[str, Family] = {f.name: f for f in (
    _family(name="llama", model_type="llama", config_class="LlamaConfig", model_class="LlamaForCausalLM",
            projections=_SEPARATE + "; attention_bias adds them", attention="-", tiny=_tiny()),
    _family(name="qwen2", model_type="qwen2", config_class="Qwen2Config", model_class="Qwen2ForCausalLM",
            projections="q_proj, k_proj, v_proj with biases", attention="per-layer sliding window (optional)",
            tiny=_tiny(), configurable_bias=False),
    _family(name="qwen3", model_type="qwen3", config_class="Qwen3Config", model_class="Qwen3ForCausalLM",
            projections=_SEPARATE + "; per-head q/k RMSNorm", attention="per-layer sliding window (optional)",
            tiny=_tiny(head_dim=16)),
    _family(name="mistral", model_type="mistral", config_class="MistralConfig", model_class="MistralForCausalLM",
            projections=_SEPARATE, attention="sliding window", tiny=_tiny(sliding_window=4),
            configurable_bias=False),
    _family(name="gemma", model_type="gemma", config_class="GemmaConfig", model_class="GemmaForCausalLM",
            projections=_SEPARATE, attention="-", tiny=_tiny(head_dim=16)),
    _family(name="gemma2", model_type="gemma2", config_class="Gemma2Config", model_class="Gemma2ForCausalLM",
            projections=_SEPARATE, attention="logit soft-capping (softcap); query_pre_attn_scalar scale; "
            "sliding and full layers",
            # a cap that bites at initialisation (|logit| ~ 0.1): dropping it changes the tiny model's logits by 1e-2
            tiny=_tiny(head_dim=16, query_pre_attn_scalar=16, sliding_window=4, attn_logit_softcapping=0.05,
                       layer_types=_TWO_LAYER_TYPES)),
    _family(name="gemma3", model_type="gemma3_text", config_class="Gemma3TextConfig",
            model_class="Gemma3ForCausalLM", projections=_SEPARATE + "; per-head q/k RMSNorm",
            attention="query_pre_attn_scalar scale; sliding and full layers (own RoPE each)",
            tiny=_tiny(head_dim=16, query_pre_attn_scalar=16, sliding_window=4, layer_types=_TWO_LAYER_TYPES),
            rope_per_layer_type=True),
    _family(name="phi3", model_type="phi3", config_class="Phi3Config", model_class="Phi3ForCausalLM",
            projections="fused qkv_proj (no bias)", attention="sliding window (optional)",
            tiny=_tiny(**_TINY_IDS), peft_targets=("qkv_proj",), configurable_bias=False),
    _family(name="olmo2", model_type="olmo2", config_class="Olmo2Config", model_class="Olmo2ForCausalLM",
            projections=_SEPARATE + "; q/k RMSNorm over all heads", attention="-",
            tiny=_tiny(**_TINY_IDS)),
    _family(name="qwen3_moe", model_type="qwen3_moe", config_class="Qwen3MoeConfig",
            model_class="Qwen3MoeForCausalLM", projections=_SEPARATE + "; per-head q/k RMSNorm",
            attention="per-layer sliding window (optional); MoE MLP",
            tiny=_tiny(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    _family(name="mixtral", model_type="mixtral", config_class="MixtralConfig", model_class="MixtralForCausalLM",
            projections=_SEPARATE, attention="sliding window (optional); MoE MLP",
            tiny=_tiny(num_local_experts=4, num_experts_per_tok=2, sliding_window=4), configurable_bias=False),
    _family(name="gpt_oss", model_type="gpt_oss", config_class="GptOssConfig", model_class="GptOssForCausalLM",
            projections="q_proj, k_proj, v_proj with biases (attention_bias)",
            attention="learned sinks (s_aux); sliding and full layers; MoE MLP", native_sinks=True,
            tiny=_tiny(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                       layer_types=_TWO_LAYER_TYPES, **_TINY_IDS,
                       # its YaRN RoPE, with the original length that makes the factor match the tiny context
                       rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                        "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 16})),
    _family(name="smollm3", model_type="smollm3", config_class="SmolLM3Config", model_class="SmolLM3ForCausalLM",
            projections=_SEPARATE, attention="NoPE layers (no RoPE on q, k); sliding window (optional)",
            tiny=_tiny(no_rope_layers=[1, 0], **_TINY_IDS)),
    _family(name="granite", model_type="granite", config_class="GraniteConfig", model_class="GraniteForCausalLM",
            projections=_SEPARATE, attention="attention_multiplier as the score scale",
            tiny=_tiny(attention_multiplier=0.1, embedding_multiplier=2.0, residual_multiplier=0.5,
                       logits_scaling=2.0)),
    # Found exact by the enumeration of transformers' decoders (docs/families.md), each laid out as the families above.
    _enumerated("afmoe", "AfmoeConfig", "AfmoeForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k norms",
                "sliding window; MoE MLP", tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32)),
    _enumerated("apertus", "ApertusConfig", "ApertusForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k norms",
                keys={"head_dim": None}),
    _enumerated("apertus1p5_text", "Apertus1p5TextConfig", "Apertus1p5TextForCausalLM",
                "q_proj, k_proj, v_proj (no bias); q/k norms", keys={"head_dim": None}),
    _enumerated("arcee", "ArceeConfig", "ArceeForCausalLM", "q_proj, k_proj, v_proj (no bias)"),
    _enumerated("aria_text", "AriaTextConfig", "AriaTextForCausalLM", "q_proj, k_proj, v_proj (no bias)"),
    _enumerated("beam", "BeamConfig", "BeamForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k norms",
                "sliding window; MoE MLP", tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32), rope_per_layer_type=True),
    _enumerated("cohere", "CohereConfig", "CohereForCausalLM", "q_proj, k_proj, v_proj (no bias)",
                keys={"rms_norm_eps": "layer_norm_eps", "head_dim": None}),
    _enumerated("cohere2", "Cohere2Config", "Cohere2ForCausalLM", "q_proj, k_proj, v_proj (no bias)",
                "sliding window", tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES),
                keys={"rms_norm_eps": "layer_norm_eps"}),
    _enumerated("cohere2_moe", "Cohere2MoeConfig", "Cohere2MoeForCausalLM", "q_proj, k_proj, v_proj (no bias)",
                "sliding window; MoE MLP", tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES, num_experts=4,
                num_experts_per_tok=2)),
    _enumerated("cohere_compass_text", "CohereCompassTextConfig", "CohereCompassForCausalLM",
                "q_proj, k_proj, v_proj (no bias)", "sliding window; NoPE full layers",
                tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES, rope_parameters={
                    # its rotary splits the head's frequencies (8 at head_dim 16) into mrope sections (5.17 needs them)
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
                    "full_attention": None}),
                rope_per_layer_type=True, keys={"rms_norm_eps": "layer_norm_eps"}),
    _enumerated("cwm", "CwmConfig", "CwmForCausalLM", "q_proj, k_proj, v_proj (no bias)", "sliding window",
                tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES), configurable_bias=False),
    _enumerated("dots1", "Dots1Config", "Dots1ForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k norms",
                "sliding window; MoE MLP", tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES,
                n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    _enumerated("ernie4_5", "Ernie4_5Config", "Ernie4_5ForCausalLM", "q_proj, k_proj, v_proj (no bias)",
                configurable_bias=False),
    _enumerated("ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", "q_proj, k_proj, v_proj (no bias)",
                tiny=dict(moe_intermediate_size=32), configurable_bias=False, keys={"head_dim": None}),
    # every n-th layer global, the rest sliding; its config names the dense and shared MLP sizes of its own
    _enumerated("ergo", "ErgoConfig", "ErgoForCausalLM", "fused qkv_proj (no bias); q/k norms",
                "sliding window; MoE MLP",
                tiny=dict(sliding_window=4, global_attention_every_n_layers=2, first_dense_intermediate_size=32,
                num_dense_blocks=1, moe_intermediate_size=32, shared_intermediate_size=32, num_experts=4,
                num_experts_per_tok=2), peft_targets=("qkv_proj",), configurable_bias=False, rope_per_layer_type=True,
                keys={"intermediate_size": "moe_intermediate_size", "tie_word_embeddings": None}),
    _enumerated("exaone4", "Exaone4Config", "Exaone4ForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k norms",
                "sliding window", tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES),
                configurable_bias=False, keys={"head_dim": None}),
    _enumerated("exaone_moe", "ExaoneMoeConfig", "ExaoneMoeForCausalLM",
                "q_proj, k_proj, v_proj (no bias); q/k norms", "sliding window; MoE MLP",
                tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32), configurable_bias=False, keys={"head_dim": None}),
    _enumerated("flex_olmo", "FlexOlmoConfig", "FlexOlmoForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k norms",
                "MoE MLP", tiny=dict(num_experts=4, num_experts_per_tok=2), keys={"head_dim": None}),
    _enumerated("flint", "FlintConfig", "FlintForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k norms",
                "sliding window; learned sinks (s_aux); MoE MLP", tiny=dict(sliding_window=4,
                layer_types=_TWO_LAYER_TYPES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32), native_sinks=True),
    _enumerated("gemma4_unified_text", "Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM",
                "q_proj, k_proj, v_proj (no bias); q/k norms", "sliding window",
                tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES), rope_per_layer_type=True),
    # KV sharing (its last layers reuse earlier layers' keys and values), AltUp, per-layer inputs
    _enumerated("gemma3n_text", "Gemma3nTextConfig", "Gemma3nForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k/v "
                "norms", "sliding window; KV-shared layers", tiny=dict(num_hidden_layers=4, sliding_window=4,
                layer_types=_TWO_LAYER_TYPES * 2, num_kv_shared_layers=2, vocab_size_per_layer_input=128,
                hidden_size_per_layer_input=16, laurel_rank=8, activation_sparsity_pattern=[0.0] * 4,
                altup_num_inputs=2), rope_per_layer_type=True),
    # full layers with their own head size and KV heads (config.per_layer_config), keys reused as values
    _enumerated("gemma4_text", "Gemma4TextConfig", "Gemma4ForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k/v "
                "norms; attention_k_eq_v: keys as values on full layers", "sliding window; per-layer head sizes",
                tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES, vocab_size_per_layer_input=128,
                hidden_size_per_layer_input=16, global_head_dim=32, attention_k_eq_v=True,
                num_global_key_value_heads=1), rope_per_layer_type=True),
    _enumerated("glm", "GlmConfig", "GlmForCausalLM", "q_proj, k_proj, v_proj with biases"),
    _enumerated("glm4", "Glm4Config", "Glm4ForCausalLM", "q_proj, k_proj, v_proj with biases"),
    _enumerated("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM", "q_proj, k_proj, v_proj (no bias)", "MoE MLP",
                tiny=dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                keys={"head_dim": None}),
    _enumerated("granite_swa", "GraniteSWAConfig", "GraniteSWAForCausalLM", "q_proj, k_proj, v_proj (no bias)",
                "sliding window; learned sinks (s_aux)", tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES),
                native_sinks=True, keys={"head_dim": None}),
    _enumerated("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM", "q_proj, k_proj, v_proj (no bias)",
                "MoE MLP", tiny=dict(num_local_experts=4, num_experts_per_tok=2), keys={"head_dim": None}),
    _enumerated("granitemoe_swa", "GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM",
                "q_proj, k_proj, v_proj (no bias)", "sliding window; learned sinks (s_aux); MoE MLP",
                tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES, num_local_experts=4,
                num_experts_per_tok=2), native_sinks=True, keys={"head_dim": None}),
    _enumerated("granitemoeshared", "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
                "q_proj, k_proj, v_proj (no bias)", "MoE MLP",
                tiny=dict(num_local_experts=4, num_experts_per_tok=2), keys={"head_dim": None}),
    _enumerated("helium", "HeliumConfig", "HeliumForCausalLM", "q_proj, k_proj, v_proj (no bias)"),
    _enumerated("hunyuan_v1_dense", "HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM",
                "q_proj, k_proj, v_proj (no bias)"),
    _enumerated("hunyuan_v1_moe", "HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM",
                "q_proj, k_proj, v_proj (no bias)", "MoE MLP", tiny=dict(num_experts=4)),
    _enumerated("hy_v3", "HYV3Config", "HYV3ForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k norms", "MoE MLP",
                tiny=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    _enumerated("hyperclovax", "HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", "q_proj, k_proj, v_proj (no bias)"),
    _enumerated("jais2", "Jais2Config", "Jais2ForCausalLM", "q_proj, k_proj, v_proj with biases",
                keys={"rms_norm_eps": "layer_norm_eps"}),
    _enumerated("kolibri1", "Kolibri1Config", "Kolibri1ForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k norms",
                "sliding window; MoE MLP", tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES,
                num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32), configurable_bias=False,
                keys={"intermediate_size": "moe_intermediate_size"}),
    _enumerated("laguna", "LagunaConfig", "LagunaForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k norms",
                "sliding window; MoE MLP", tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
                rope_per_layer_type=True),
    _enumerated("mellum", "MellumConfig", "MellumForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k norms",
                "sliding window; MoE MLP", tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES,
                num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), rope_per_layer_type=True),
    # its q_gate_proj makes the queries and an output gate (applied after the attention function, outside the seam)
    _enumerated("minicpm5_moe", "MiniCPM5MoeConfig", "MiniCPM5MoeForCausalLM",
                "q_gate_proj (queries and an output gate), k_proj, v_proj (no bias)", "MoE MLP",
                tiny=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                peft_targets=("q_gate_proj", "v_proj")),
    _enumerated("minimax_m2", "MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                "q_proj, k_proj, v_proj (no bias); q/k norms", "MoE MLP",
                tiny=dict(num_local_experts=4, num_experts_per_tok=2), configurable_bias=False),
    _enumerated("ministral", "MinistralConfig", "MinistralForCausalLM", "q_proj, k_proj, v_proj (no bias)",
                "sliding window", tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES),
                configurable_bias=False),
    _enumerated("ministral3", "Ministral3Config", "Ministral3ForCausalLM", "q_proj, k_proj, v_proj (no bias)",
                "sliding window", tiny=dict(sliding_window=4), configurable_bias=False),
    _enumerated("nanochat", "NanoChatConfig", "NanoChatForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k norms",
                keys={"head_dim": None}),
    _enumerated("olmo", "OlmoConfig", "OlmoForCausalLM", "q_proj, k_proj, v_proj (no bias)",
                keys={"rms_norm_eps": None, "head_dim": None}),
    _enumerated("olmo3", "Olmo3Config", "Olmo3ForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k norms",
                "sliding window", tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES),
                rope_per_layer_type=True, keys={"head_dim": None}),
    _enumerated("olmoe", "OlmoeConfig", "OlmoeForCausalLM", "q_proj, k_proj, v_proj (no bias); q/k norms",
                "MoE MLP", tiny=dict(num_experts=4, num_experts_per_tok=2), keys={"head_dim": None}),
    # Their attention passes no sliding_window: the window of the mask their decoder builds (mask_window).
    _enumerated("phimoe", "PhimoeConfig", "PhimoeForCausalLM", "q_proj, k_proj, v_proj (no bias)",
                "sliding window (decoder's mask, every layer); MoE MLP", tiny=dict(sliding_window=4,
                num_local_experts=4, num_experts_per_tok=2), mask_window="every_layer", keys={"head_dim": None}),
    _enumerated("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "q_proj, k_proj, v_proj with biases (qkv_bias)",
                "per-layer sliding window (decoder's mask, optional); MoE MLP", tiny=dict(use_sliding_window=True,
                sliding_window=4, layer_types=_TWO_LAYER_TYPES, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=32), mask_window="layer_types",
                keys={"head_dim": None, "attention_bias": "qkv_bias"}),
    # CCA: q, k, v from short convolutions over neighbouring tokens, before the attention function (across packed
    # documents too, in transformers' own eager attention as after conversion)
    _enumerated("zaya", "ZayaConfig", "ZayaForCausalLM", "qkv_proj: q_proj, k_proj, v_proj_current, v_proj_delayed "
                "and q/k convolutions; q/k norm", "sliding window (hybrid_sliding layers); MoE MLP",
                tiny=dict(layer_types=["hybrid_sliding", "hybrid"], sliding_window=4, num_experts=4,
                num_experts_per_tok=1, moe_intermediate_size=32, router_hidden_size=16), peft_targets=("q_proj", "k_proj"),
                keys={"intermediate_size": "moe_intermediate_size"}),
    # Their decoder layers call self_attn without **kwargs: exact because the seam's context rides in attention_mask.
    _enumerated("nemotron", "NemotronConfig", "NemotronForCausalLM", "q_proj, k_proj, v_proj (no bias)",
                "partial RoPE", keys={"rms_norm_eps": "norm_eps"}),
    _enumerated("seed_oss", "SeedOssConfig", "SeedOssForCausalLM", "q_proj, k_proj, v_proj with biases"),
    _enumerated("solar_open", "SolarOpenConfig", "SolarOpenForCausalLM", "q_proj, k_proj, v_proj (no bias)",
                "MoE MLP", tiny=dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                keys={"intermediate_size": "moe_intermediate_size"}),
    _enumerated("stablelm", "StableLmConfig", "StableLmForCausalLM", "q_proj, k_proj, v_proj (use_qkv_bias adds "
                "biases)", "partial RoPE", keys={"rms_norm_eps": "layer_norm_eps", "head_dim": None,
                                                  "attention_bias": "use_qkv_bias"}),
    _enumerated("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", "q_proj, k_proj, v_proj with biases",
                "sliding window", tiny=dict(sliding_window=4), configurable_bias=False,
                keys={"rms_norm_eps": "norm_epsilon", "head_dim": None}),
    _enumerated("vaultgemma", "VaultGemmaConfig", "VaultGemmaForCausalLM", "q_proj, k_proj, v_proj (no bias)",
                "sliding window; softcap", tiny=dict(sliding_window=4, layer_types=_TWO_LAYER_TYPES)),
)}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[name]


def masked_window(mask_window: str | None, config, layer_idx: int) -> int | None:
    """The window a family's decoder masks on layer `layer_idx` but does not pass on (Family.mask_window), read from
    `config` as it is now: the seam calls this on every forward, so an edit of config.sliding_window reaches the
    converted layer as it reaches the decoder's own mask (a copy made at conversion would go stale)."""
    if mask_window is None:
        return None
    if mask_window == "every_layer":
        return config.sliding_window
    if mask_window == "layer_types":
        return config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
    raise ValueError(f"unknown mask_window {mask_window!r}; use 'every_layer', 'layer_types' or None")


def family_of_config(config) -> Family:
    """The family of a transformers config: its model_type, or `affine_<family>` for a converted one."""
    model_type = getattr(config, "model_type", "")
    for f in FAMILIES.values():
        if model_type in (f.model_type, f"affine_{f.name}"):
            return f
    raise ValueError(f"model type {model_type!r} is not a supported family; supported: {sorted(FAMILIES)}")


def family_names(*, core: bool = False) -> list[str]:
    """The table's families; core=True: only those the per-family test files run (Family.core)."""
    return [name for name, f in FAMILIES.items() if f.core or not core]


def refusal(family: str, variant: str) -> str | None:
    """Why `variant` cannot convert a model of `family` exactly, or None when it can."""
    from ..variants import get_variant

    cls = get_variant(variant)
    if get_family(family).native_sinks and cls.refuses_model_sinks:
        return cls.refuses_model_sinks
    return None
