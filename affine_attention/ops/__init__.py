"""The attention math as pure functions on tensors: fast paths and a readable reference for each variant."""
from .attention import affine_scaled_attention, off_by_one_attention, sink_attention, softmax_attention
from .call import AttentionCall, Score, Softcap
from .reference import (
    affine_scaled_attention_reference,
    attention_logits,
    sink_attention_reference,
    softmax_attention_reference,
    visible_mask,
)

__all__ = [
    "affine_scaled_attention", "sink_attention", "off_by_one_attention", "softmax_attention",
    "affine_scaled_attention_reference", "sink_attention_reference", "softmax_attention_reference",
    "attention_logits", "visible_mask", "AttentionCall", "Score", "Softcap",
]
