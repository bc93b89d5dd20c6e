"""An example attention variant written the way a new one is added: this one file plus one registry line
(`register_variant(HeadGainAttention)`, done by the test that uses it). It is a test of the extension points, not a
method: softmax attention times a learnable gain per head."""
from __future__ import annotations

import torch
from torch import nn

from affine_attention.variants.base import OKABE_ITO, AttentionVariant, Display


class HeadGainAttention(AttentionVariant):
    name = "example_head_gain"
    role = "method"
    controls = ("scaled_softmax",)
    display = Display("Head gain (example)", OKABE_ITO["yellow"], "h", (0, (1, 2)))
    token_stats = {"gain": "head gain"}
    state_stats = {"head_gain": "head gain"}

    def __init__(self, shape, options=None):
        super().__init__(shape, options)
        self.head_gain = nn.Parameter(torch.ones(shape.num_heads))

    def output_gate(self, x):
        """The extension point for what multiplies the kernel's output: the gain of each head as the epilogue's
        gate, (1, Hq, 1, 1) (x: (B, T, hidden) is not needed)."""
        return self.head_gain.to(x.dtype)[None, :, None, None]

    def token_statistics(self, x):
        B, T, _ = x.shape
        return {"gain": self.head_gain.detach().float()[None, :, None].expand(B, -1, T)}

    def state_statistics(self):
        return {"head_gain": self.head_gain}
