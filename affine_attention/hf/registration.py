"""The one registration with transformers: the seam's attention and mask functions (hf.attention) and the converted
model types (hf.models). The only module that imports both; hf._autoload runs it when transformers is imported."""
from __future__ import annotations

import sys
from types import ModuleType

import transformers
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface

from . import attention, models


def register() -> None:
    """Register (idempotent) the attention function and the mask function under ATTN_IMPLEMENTATION, and every
    converted config and model class with AutoConfig / AutoModelForCausalLM."""
    AttentionInterface.register(attention.ATTN_IMPLEMENTATION, attention.attention_forward)
    AttentionMaskInterface.register(attention.ATTN_IMPLEMENTATION, attention.structured_mask)
    for config_cls, model_cls in models.converted_classes():
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
        # Tools that resolve `config.architectures[0]` as an attribute of transformers (`transformers serve`'s model
        # manager) would otherwise fail on a converted checkpoint with "no attribute AffineLlamaForCausalLM".
        for module in _transformers_module_objects():
            for cls in (config_cls, model_cls):
                setattr(module, cls.__name__, cls)


def _transformers_module_objects() -> list[ModuleType]:
    """Every module object named `transformers` that loaded code holds. transformers' processing_utils re-executes
    transformers/__init__ (`direct_transformers_import`), which replaces sys.modules["transformers"]: modules that
    imported transformers before that (e.g. `transformers serve`'s model manager) keep the older object."""
    found = {id(transformers): transformers}
    for module in list(sys.modules.values()):
        held = getattr(module, "__dict__", {}).get("transformers")
        if isinstance(held, ModuleType) and held.__name__ == "transformers":
            found[id(held)] = held
    current = sys.modules.get("transformers")
    if current is not None:
        found[id(current)] = current
    return list(found.values())
