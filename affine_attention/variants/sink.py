"""Attention sink (GPT-OSS): one learnable logit per query head in the softmax denominator; off-by-one fixes it at 0."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..ops import sink_attention, sink_attention_reference
from .base import AttentionVariant


@dataclass(frozen=True)
class SinkOptions:
    init: float = 0.0  # initial sink logit; 0 makes the untrained sink exactly off-by-one


class SinkAttention(AttentionVariant):
    name = "sink"
    Options = SinkOptions

    def __init__(self, shape, options=None):
        super().__init__(shape, options)
        self.sinks = nn.Parameter(torch.full((shape.num_heads,), self.options.init))

    def _sink_logits(self):
        return self.sinks

    def attend(self, q, k, v, x, *, mask, scale, token_mask, v_mean, backend):
        return sink_attention(q, k, v, self._sink_logits().to(q.device), **mask, scale=scale, enable_gqa=self._gqa,
                              backend=backend)

    def attend_reference(self, q, k, v, x, *, mask, scale):
        out, w = sink_attention_reference(q, k, v, self._sink_logits().to(q.device, q.dtype), **mask, scale=scale,
                                          enable_gqa=self._gqa)
        return out, w, {"sink_mass": 1.0 - w.sum(-1)}


class OffByOneAttention(SinkAttention):
    """Softmax with +1 in the denominator: a sink whose logit is fixed at 0.

    The zeros are made per call rather than held in a buffer: a non-persistent buffer would come back
    uninitialised whenever a model is materialised from the meta device (from_pretrained, FSDP, to_empty)."""

    name = "off_by_one"
    Options = AttentionVariant.Options

    def __init__(self, shape, options=None):
        AttentionVariant.__init__(self, shape, options)

    def _sink_logits(self):
        return torch.zeros(self.shape.num_heads)
