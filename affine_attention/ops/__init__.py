"""The attention math as pure functions on tensors: fast paths and a readable reference for each variant."""
from .affine import affine_scaled_attention
from .reference import (
    affine_scaled_attention_reference,
    attention_logits,
    sink_attention_reference,
    softmax_attention_reference,
    visible_mask,
)
from .sink import off_by_one_attention, sink_attention, softmax_attention

__all__ = [
    "affine_scaled_attention", "sink_attention", "off_by_one_attention", "softmax_attention",
    "affine_scaled_attention_reference", "sink_attention_reference", "softmax_attention_reference",
    "attention_logits", "visible_mask",
]
