"""`convert(model, variant, **options)`: turn a transformers causal LM, in place, into one running an attention
variant, keeping every existing weight and name."""
from __future__ import annotations

import copy

import torch
from torch import nn

from . import models
from .attention import ATTN_IMPLEMENTATION
from .layers import CONFIG_KEY, attach_variants, make_spec


def convert(model: nn.Module, variant: str, **options) -> nn.Module:
    """Convert a transformers Llama / Qwen2 / Qwen3 / Mistral causal LM in place to an attention variant.

    Every existing weight keeps its name; the variant's parameters appear as
    `model.layers.<i>.self_attn.attn_variant.<name>` (alpha_proj.weight, gate_proj.weight, sinks; buffer alpha_ma).
    The variant and its options are recorded in `model.config.affine_attention`, the model's attention
    implementation becomes 'affine_attention', and its class becomes the registered `Affine*ForCausalLM`, so
    `save_pretrained` writes a checkpoint that `from_pretrained` restores after `import affine_attention` (and that
    refuses to load as plain softmax attention without it). Returns the same model object.
    """
    family = models.family_of(model)  # ValueError for converted or unsupported models
    spec = make_spec(variant, options)
    if getattr(model.config, "attention_dropout", 0.0):
        raise ValueError(f"attention dropout ({model.config.attention_dropout}) is not supported by affine_attention "
                         "variants; set `model.config.attention_dropout = 0.0` first")
    config_cls, model_cls = models.affine_classes(family)
    with torch.no_grad():
        attach_variants(model, spec)
    _give_own_config(model)
    setattr(model.config, CONFIG_KEY, spec)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    # The model keeps its identity and weights; only its class (and its config's) change to the registered
    # subclasses, which add nothing but the save/load behaviour of converted checkpoints.
    model.config.__class__ = config_cls
    model.__class__ = model_cls
    model.config.auto_map = model_cls.hub_auto_map()
    return model


def _give_own_config(model: nn.Module) -> None:
    """Point the model and its submodules at a copy of their config, so converting never changes a config object
    the caller still holds (transformers shares the one passed to `from_config` with the model)."""
    old = model.config
    new = copy.deepcopy(old)
    for module in model.modules():
        if getattr(module, "config", None) is old:
            module.config = new
