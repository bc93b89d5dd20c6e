"""PEFT (LoRA and other adapters) on converted models: the adapter config that makes save -> reload exact.

A converted model's attention variants hold trainable parameters (alpha_proj, gate_proj, sinks) and running
statistics (the alpha_ma buffer, stepped by `step_running_stats`). A plain `LoraConfig` freezes the first and
leaves the second outside the adapter, so the saved adapter does not reproduce the trained model. `peft_config`
puts every layer's `attn_variant` module into `modules_to_save` (PEFT trains and saves a copy of each; the base
model stays untouched) and keeps LoRA's `target_modules` out of it:

    from peft import LoraConfig, get_peft_model
    from affine_attention.hf.peft import peft_config

    model = get_peft_model(model, peft_config(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"])))
    # train with callbacks=[RunningStatsCallback()] (or call step_running_stats(model) after each optimizer step)
    model.save_pretrained("adapter")
    # later, in any process: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "adapter")
"""
from __future__ import annotations

import copy
import re
import warnings

from torch import nn

from .families import family_of_config
from .layers import VARIANT_ATTR, variant_spec


def peft_config(model: nn.Module, config=None, **lora_options):
    """A copy of `config` (a peft config with `modules_to_save`, e.g. LoraConfig; default: LoraConfig(**lora_options))
    that also trains and saves every layer's attention variant; `model` is the converted model it will wrap.

    target_modules None means PEFT's default for the model's family (families.Family.peft_targets: ["q_proj",
    "v_proj"] for most, ["qkv_proj"] for Phi-3's fused projection). Names given
    (e.g. ["q_proj", "gate_proj"]) become a regex matching only modules outside the
    variants, so a name the variant shares with the model (gated's `gate_proj`, the MLP's `gate_proj`) gets LoRA
    in the MLP and stays fully trained in the variant. A target_modules regex (a str) is passed on unchanged.
    """
    if variant_spec(model) is None:
        raise ValueError("peft_config: the model is not converted (no config.affine_attention); convert it first "
                         "with affine_attention.convert(model, variant), or use a plain peft config")
    if config is None:
        from peft import LoraConfig

        config = LoraConfig(**lora_options)
    elif lora_options:
        raise ValueError(f"peft_config: pass either a config or keyword options, not both (got {sorted(lora_options)})")
    if not hasattr(config, "modules_to_save"):
        raise ValueError(f"peft_config: {type(config).__name__} has no `modules_to_save`, so the attention variants "
                         "could not be saved with the adapter; use a config that has it (LoraConfig, IA3Config, ...)")
    config = copy.deepcopy(config)
    config.modules_to_save = sorted(set(config.modules_to_save or ()) | {VARIANT_ATTR})
    targets = config.target_modules
    if targets is None:
        # PEFT's own default for the family; it does not know the converted model types (affine_llama, ...).
        targets = family_of_config(model.config).peft_targets
    if targets == "all-linear" or (not isinstance(targets, str) and "all-linear" in targets):
        raise ValueError("peft_config: target_modules='all-linear' would put LoRA inside the attention variants; "
                         "name the modules instead, e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj']")
    if not isinstance(targets, str):
        names = sorted(targets)
        # PEFT matches a str against every module's full name: any module ending in one of `names`, not below a variant.
        config.target_modules = (rf"^(?!.*\.{VARIANT_ATTR}\.).*\.({'|'.join(map(re.escape, names))})$")
    return config


class AdapterWarning(UserWarning):
    """A PEFT model whose attention variants are not part of its adapter (built without `peft_config`)."""


def check_adapter(model: nn.Module) -> bool:
    """Warn (AdapterWarning) when `model` is a PEFT model whose attention variants are outside the adapter: they stay
    frozen, alpha_ma would be stepped in the base model and the saved adapter would not reproduce the trained model.
    Returns True when the model is fine (or not a PEFT model). `RunningStatsCallback` calls it when training starts."""
    if not hasattr(model, "peft_config"):
        return True
    outside = [n for n, m in model.named_modules()
               if n.endswith(f".{VARIANT_ATTR}") and type(m).__name__ != "ModulesToSaveWrapper"]
    if outside:
        warnings.warn(f"this PEFT model leaves its attention variants out of the adapter ({len(outside)} layers, e.g. "
                      f"{outside[0]}): build its config with affine_attention.peft_config(model, LoraConfig(...)) so "
                      "that the variants train and save with the adapter", AdapterWarning, stacklevel=2)
    return not outside
