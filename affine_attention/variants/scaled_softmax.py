"""Control: softmax attention times a per-head output scale (constant or learnable), no input dependence."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .base import AttentionVariant


@dataclass(frozen=True)
class ScaledSoftmaxOptions:
    scale: float = 0.5  # affine starts at alpha = 0.5 and the gate at sigmoid(0) = 0.5: the same output scale
    learnable: bool = False  # one learnable scalar per head, initialised to `scale`


class ScaledSoftmaxAttention(AttentionVariant):
    name = "scaled_softmax"
    Options = ScaledSoftmaxOptions
    control = True

    def __init__(self, shape, options=None):
        super().__init__(shape, options)
        if self.options.learnable:
            self.output_scale = nn.Parameter(torch.full((shape.num_heads,), self.options.scale))

    def output_gate(self, x: Tensor) -> Tensor | float:
        """The per-head output scale as the epilogue's gate: (1, Hq, 1, 1), or a plain float when constant (no
        buffer to lose on meta init)."""
        if not self.options.learnable:
            return self.options.scale
        return self.output_scale.to(x.dtype)[None, :, None, None]
