"""Attention variants on the layers of a transformers causal LM: the config record, attaching one variant module
and the input-capturing pre-hook to every attention layer."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ..variants import AttentionShape, build_variant, options_to_dict, parse_options, variant_names
from ..variants.running_stats import accumulator_names
from . import packing
from .attention import LAYER_WINDOW_ATTR, capture_attention_input
from .families import Family, family_of_config

CONFIG_KEY = "affine_attention"  # config.affine_attention = {"variant": name, "options": {...}}
VARIANT_ATTR = "attn_variant"  # new parameters are named ...self_attn.attn_variant.<name>
_HOOK_ATTR = "_affine_attention_hook"
# The keys of config.affine_attention; "retrofit" is written by convert(..., function_preserving=True).
SPEC_KEYS = {"variant", "options", "retrofit"}


def make_spec(variant: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Validated, JSON-ready record of a variant and its options (all defaults filled in)."""
    if not isinstance(variant, str):
        raise ValueError(f"variant must be a name (one of {variant_names()}), got {variant!r}")
    opts = parse_options(variant, options)  # unknown variant / option -> ValueError
    return {"variant": variant, "options": options_to_dict(opts)}


def spec_from_config(config) -> dict[str, Any]:
    """The variant record stored in a model config; ValueError if it is missing or malformed."""
    spec = getattr(config, CONFIG_KEY, None)
    if not isinstance(spec, Mapping) or not isinstance(spec.get("variant"), str):
        raise ValueError(
            f"config.{CONFIG_KEY} must be a dict {{'variant': name, 'options': {{...}}}} naming one of "
            f"{variant_names()}, got {spec!r}; build converted models with `affine_attention.convert(model, variant)`")
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise ValueError(f"config.{CONFIG_KEY} has unknown key(s) {unknown}; expected {sorted(SPEC_KEYS)}")
    options = spec.get("options") or {}
    if not isinstance(options, Mapping):
        raise ValueError(f"config.{CONFIG_KEY}['options'] must be a dict, got {options!r}")
    return make_spec(spec["variant"], options)


def check_saved_spec(config, where: str) -> None:
    """A saved config must record every option of its variant (convert writes them all): loading one with options
    missing would silently run the defaults, which may differ from what the weights were trained with."""
    spec = spec_from_config(config)
    saved = getattr(config, CONFIG_KEY).get("options") or {}
    missing = sorted(set(spec["options"]) - set(saved))
    if missing:
        raise ValueError(f"{where}: config.json's {CONFIG_KEY}.options lacks {missing} of the {spec['variant']!r} "
                         f"variant; a saved model must record every option (write them back, e.g. "
                         f"{ {k: spec['options'][k] for k in missing} }, or save it again with save_pretrained)")


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer (model.model.layers[i].self_attn)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no `model.layers`: pass the *ForCausalLM model")
    return [layer.self_attn for layer in layers]


def layer_shape(config, attn: nn.Module) -> AttentionShape:
    """The sizes of one attention layer of a transformers model."""
    head_dim = getattr(attn, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # transformers' per-layer view of a config (newer versions): Gemma 4's full layers have KV heads of their own.
    per_layer = getattr(config, "per_layer_config", None)
    kv_heads = (per_layer[attn.layer_idx] if per_layer is not None else config).num_key_value_heads
    return AttentionShape(config.hidden_size, config.num_attention_heads, kv_heads, head_dim)


def attach_variants(model: nn.Module, spec: Mapping[str, Any], family: Family | None = None) -> None:
    """Give every attention layer an `attn_variant` module and the pre-hook that captures its input x. family: the
    model's entry of the family table (default: read from its config's model type)."""
    config = model.config
    family = family if family is not None else family_of_config(config)
    for attn in attention_layers(model):
        if hasattr(attn, VARIANT_ATTR):
            raise ValueError(f"layer {attn.layer_idx} already has an attention variant "
                             f"({getattr(attn, VARIANT_ATTR).name!r}); convert an unconverted model")
        variant = build_variant(spec["variant"], layer_shape(config, attn), **spec["options"])
        if family.native_sinks:
            try:
                variant.adopt_model_sinks()
            except ValueError as err:
                raise ValueError(f"cannot convert a {family.name} model to {spec['variant']!r}: {err}") from None
        ref = next(m.weight for m in attn.modules() if isinstance(m, nn.Linear))  # q_proj, or a fused qkv_proj
        # New parameters follow the layer's device and dtype (meta while transformers builds the model to load).
        variant.to(device=ref.device, dtype=ref.dtype if ref.is_floating_point() else None)
        variant.train(attn.training)  # an eval-mode model must not start updating alpha_ma
        attn.add_module(VARIANT_ATTR, variant)
        setattr(attn, LAYER_WINDOW_ATTR, family.mask_window)  # the rule: the window is read per call
        setattr(attn, _HOOK_ATTR, attn.register_forward_pre_hook(capture_attention_input, with_kwargs=True))
    packing.attach(model)
    _keep_accumulators_local(model)


def _keep_accumulators_local(model: nn.Module) -> None:
    """DDP broadcasts rank 0's buffers before every forward by default (transformers' Trainer keeps that
    default): it would overwrite each rank's running-statistics accumulator between micro-batches. DDP skips the
    names listed here on the module it wraps (the causal LM): the accumulators of the running-statistics protocol
    (variants.running_stats); the statistics themselves are equal on every rank anyway."""
    names = accumulator_names(model)
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    model._ddp_params_and_buffers_to_ignore = ignored + [n for n in names if n not in ignored]


def variant_spec(model: nn.Module) -> dict[str, Any] | None:
    """The {"variant", "options"} record of a converted model, or None for an unconverted one."""
    spec = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    return dict(spec) if spec is not None else None
