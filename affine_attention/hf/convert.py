"""`convert(model, variant, **options)`: turn a transformers causal LM, in place, into one running an attention
variant, keeping every existing weight and name."""
from __future__ import annotations

import copy

import torch
from torch import nn

from . import models
from .attention import ATTN_IMPLEMENTATION
from .families import Family, get_family
from .load import release_gguf_quantizer
from .registration import register
from ..variants import build_variant
from .layers import CONFIG_KEY, VARIANT_ATTR, attach_variants, attention_layers, layer_shape, make_spec


def convert(model: nn.Module, variant: str, *, function_preserving: bool = False, **options) -> nn.Module:
    """Convert a transformers Llama / Qwen2 / Qwen3 / Mistral causal LM (or a subclass of one) in place to an
    attention variant.

    function_preserving=True (a retrofit, for continued training of a pretrained model): the converted model computes
    what it computed before and every new parameter still receives gradient. Each variant starts in a state whose
    output is a constant c times softmax attention (affine: alpha_ma = phi(0), c = 0.5; gated: c = 0.5; both:
    0.25; scaled_softmax: its scale; sink: a logit of -40, a mass float32 rounds away, c = 1) and 1 / c is folded into
    `o_proj`. Keep the default False for from-scratch comparisons, which follow the paper's initialisation.

    Every existing weight keeps its name; the variant's parameters appear as
    `model.layers.<i>.self_attn.attn_variant.<name>` (alpha_proj.weight, gate_proj.weight, sinks; buffer alpha_ma).
    The variant and its options are recorded in `model.config.affine_attention`, the model's attention
    implementation becomes 'affine_attention', and its class becomes the registered `Affine*ForCausalLM`, so
    `save_pretrained` writes a checkpoint that `from_pretrained` restores after `import affine_attention` (and that
    refuses to load as plain softmax attention without it). Returns the same model object.
    """
    family = _family_or_refusal(model)
    spec = make_spec(variant, options)
    if getattr(model.config, "attention_dropout", 0.0):
        raise ValueError(f"attention dropout ({model.config.attention_dropout}) is not supported by affine_attention "
                         "variants; set `model.config.attention_dropout = 0.0` first")
    if not isinstance(function_preserving, bool):
        raise ValueError(f"function_preserving must be True or False, got {function_preserving!r}")
    config_cls, model_cls = models.affine_classes(family, type(model))
    release_gguf_quantizer(model)
    convert_layers(model, get_family(family), spec, function_preserving)  # by class: a subclass may have its own type
    # The model keeps its identity and weights; only its class (and its config's) change to the registered
    # subclasses, which add nothing but the save/load behaviour of converted checkpoints.
    model.config.__class__ = config_cls
    model.__class__ = model_cls
    model.config.auto_map = model_cls.hub_auto_map()
    return model


def _family_or_refusal(model: nn.Module) -> str:
    """The model's family; for a family transformers ships that the enumeration refused, a ValueError naming it and
    the reason (families_refused.py), else models.family_of's ValueError (converted or unknown models)."""
    from .families_refused import refusal_message

    try:
        return models.family_of(model)
    except ValueError:
        why = refusal_message(getattr(getattr(model, "config", None), "model_type", None))
        if why is None:
            raise
        raise ValueError(f"cannot convert {type(model).__name__}: {why}") from None


def convert_layers(model: nn.Module, family: Family, spec: dict, function_preserving: bool) -> None:
    """The attention part of `convert`, for a model laid out as `family` says: every layer's variant, the retrofit's
    output scale, the spec in the config and the seam as the attention implementation (the class stays)."""
    if function_preserving:
        # A variant that cannot preserve the function says so before anything is attached.
        probe = build_variant(spec["variant"], layer_shape(model.config, attention_layers(model)[0]),
                              **spec["options"])
        probe.retrofit()
        spec["retrofit"] = {"function_preserving": True, "weight_scale": probe.retrofit_weight_scale()}
    with torch.no_grad():
        attach_variants(model, spec, family)
        if function_preserving:
            spec["retrofit"]["o_proj_scale"] = _fold_output_scale(model)
    _give_own_config(model)
    setattr(model.config, CONFIG_KEY, spec)
    register()  # transformers accepts the implementation (and AutoModelForCausalLM the saved model) once registered
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


def _give_own_config(model: nn.Module) -> None:
    """Point the model and its submodules at a copy of their config, so converting never changes a config object
    the caller still holds (transformers shares the one passed to `from_config` with the model)."""
    old = model.config
    new = copy.deepcopy(old)
    for module in model.modules():
        if getattr(module, "config", None) is old:
            module.config = new


def _fold_output_scale(model: nn.Module) -> float:
    """Put every new variant module into its function-preserving state; fold 1 / c into each o_proj. Returns 1 / c."""
    factors = set()
    for attn in attention_layers(model):
        c = getattr(attn, VARIANT_ATTR).retrofit()
        if c != 1.0:
            # Only the weight: an o_proj bias is added after the projection and stays as it was.
            attn.o_proj.weight.mul_(1.0 / c)
        factors.add(1.0 / c)
    (factor,) = factors  # one variant for every layer, so one factor
    return factor
