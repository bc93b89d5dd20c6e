"""Control: softmax attention times a per-head output scale (constant or learnable), no input dependence."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .base import OKABE_ITO, AttentionVariant, Display


@dataclass(frozen=True)
class ScaledSoftmaxOptions:
    scale: float = 0.5  # affine starts at alpha = 0.5 and the gate at sigmoid(0) = 0.5: the same output scale
    learnable: bool = False  # one learnable scalar per head, initialised to `scale`

    def __post_init__(self):
        if not (math.isfinite(self.scale) and self.scale >= 0):
            raise ValueError(f"scaled_softmax: option 'scale' must be a finite number >= 0, got {self.scale}")


class ScaledSoftmaxAttention(AttentionVariant):
    name = "scaled_softmax"
    Options = ScaledSoftmaxOptions
    role = "control"
    isolates = "what the method adds beyond a constant 0.5 output scale"
    display = Display("Scaled softmax", OKABE_ITO["orange"], "X", (0, (3, 1, 1, 1, 1, 1)))

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

    def retrofit(self) -> float:
        if not self.options.scale > 0:
            raise ValueError(f"scaled_softmax: scale = {self.options.scale} cannot preserve the model's function "
                             "(1 / scale is folded into o_proj); use a positive scale")
        return self.options.scale * super().retrofit()
