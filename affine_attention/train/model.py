"""The student: a transformers causal LM built from [model] (no network), converted to an attention variant, and its
parameter count (the memory estimate `--dry-run` prints is in dryrun.py)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from .config import ModelConfig, RunConfig


def hf_config(mc: ModelConfig, *, eos_token_id: int | None = None, pad_token_id: int | None = None):
    """The transformers config for [model]."""
    from ..hf.families import get_family

    family = get_family(mc.arch)
    cls = family.classes()[0]
    rope = {"rope_type": "default", "rope_theta": mc.rope_theta, **mc.rope_scaling}
    if family.rope_per_layer_type:
        rope = {kind: dict(rope) for kind in ("sliding_attention", "full_attention")}
    kwargs = dict(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
        head_dim=mc.head_dim or mc.hidden_size // mc.num_heads, tie_word_embeddings=mc.tie_embeddings,
        max_position_embeddings=mc.max_position_embeddings, rms_norm_eps=mc.rms_norm_eps,
        initializer_range=mc.initializer_range,
        rope_parameters=rope,
        bos_token_id=eos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id, use_cache=False,
    )
    if family.configurable_bias:
        kwargs["attention_bias"] = mc.attention_bias
    elif mc.attention_bias:
        raise ValueError(f"model.attention_bias = true: the {family.name} architecture fixes its projection biases "
                         f"({family.projections}); remove the key")
    _rename_keys(kwargs, family, mc)
    kwargs.update(mc.extra)
    return cls(**kwargs)


# The [model] fields behind each config key a family may name differently (families.Family.config_keys).
_FIELDS_OF_KEY = {"rms_norm_eps": ("rms_norm_eps",), "intermediate_size": ("intermediate_size",),
                  "head_dim": ("head_dim",), "initializer_range": ("initializer_range",),
                  "rope_parameters": ("rope_theta", "rope_scaling"), "tie_word_embeddings": ("tie_embeddings",)}


def _rename_keys(kwargs: dict, family, mc: ModelConfig) -> None:
    """Give each value the family's own config key (e.g. Cohere's `layer_norm_eps`): a config class takes an unknown
    key without a word, so `rms_norm_eps` would be dropped silently. A family without the setting at all refuses a
    [model] value other than the default, naming the key."""
    defaults = ModelConfig()
    for key, target in family.config_keys.items():
        value = kwargs.pop(key)
        if target is not None:
            kwargs[target] = value
            continue
        given = [name for name in _FIELDS_OF_KEY[key] if getattr(mc, name) != getattr(defaults, name)]
        if given:
            raise ValueError(f"model.{given[0]} is set, but the {family.name} architecture has no `{key}` setting "
                             f"(its config class {family.config_class} fixes it); remove the key")


def build_base(mc: ModelConfig, seed: int, *, meta: bool = False, eos_token_id: int | None = None,
               pad_token_id: int | None = None) -> nn.Module:
    """An unconverted fp32 model initialised from `seed` (on the meta device for counting)."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(mc, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def tokenizer_spec(cfg: RunConfig) -> str:
    """The tokenizer a run uses: data.tokenizer, or the pretrained model's own when [model].init_from is set and
    data.tokenizer is left at "default"."""
    if cfg.model.init_from and cfg.data.tokenizer == "default":
        return cfg.model.init_from
    return cfg.data.tokenizer


def function_preserving(mc: ModelConfig) -> bool:
    """[model].function_preserving, whose unset default is: a retrofit with init_from, the paper's init without."""
    return bool(mc.init_from) if mc.function_preserving is None else mc.function_preserving


def base_model(cfg: RunConfig, seed: int, *, meta: bool = False, eos_token_id: int | None = None,
               pad_token_id: int | None = None) -> nn.Module:
    """The unconverted fp32 model a run starts from: [model].init_from's weights, or a fresh one from `seed`."""
    mc = cfg.model
    if not mc.init_from:
        return build_base(mc, seed, meta=meta, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..hf.load import load_model, resolve

    if meta:
        path, kwargs = resolve(mc.init_from)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, **kwargs), dtype=torch.float32)
    loaded = load_model(mc.init_from, dtype=torch.float32)
    # A model read from GGUF cannot be saved by transformers: the same (dequantised) weights in a plain model can.
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    return model.train()


def convert_fn():
    """affine_attention.convert, with a clear error while the hf layer is missing or broken."""
    try:
        from affine_attention.hf.convert import convert as fn
    except ImportError as err:
        raise RuntimeError("affine_attention.convert is not available (affine_attention/hf is missing or broken: "
                           f"{err}); training needs it to install the attention variant") from err
    return fn


def convert(base: nn.Module, variant: str, options: dict | None = None, *, copy_model: bool = True,
            function_preserving: bool = False) -> nn.Module:
    """A converted copy of `base` (shared weights identical; the variant's new parameters get their own init, or
    the function-preserving one)."""
    model = copy.deepcopy(base) if copy_model else base
    device = next(model.parameters()).device
    with torch.device(device):  # new variant parameters live where the model lives (meta for counting)
        model = convert_fn()(model, variant, function_preserving=function_preserving, **dict(options or {}))
    return model


def variant_options(cfg: RunConfig, variant: str) -> dict:
    """Options for `variant`: [variant].options when it is the [variant] name, merged with [compare].options."""
    opts = dict(cfg.variant.options) if variant == cfg.variant.name else {}
    opts.update(cfg.compare.options.get(variant, {}))
    return opts


def count_params(model: nn.Module) -> int:
    """Unique parameters (a tied head counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

