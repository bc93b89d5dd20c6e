"""The one registration with transformers: the seam's attention and mask functions (hf.attention) and the converted
model types (hf.models). The only module that imports both; hf._autoload runs it when transformers is imported."""
from __future__ import annotations

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
