"""Gated attention (Qiu et al. 2025): out * sigmoid(W_g x) before the output projection, elementwise or per head."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from .base import OKABE_ITO, AttentionVariant, Display


@dataclass(frozen=True)
class GatedOptions:
    # elementwise: W_g hidden -> Hq*D (the paper's overheads); headwise: hidden -> Hq.
    gate: Literal["elementwise", "headwise"] = "elementwise"


class GateMixin:
    """Adds `gate_proj` (no bias, zero init: every gate starts at sigmoid(0) = 0.5); the epilogue applies the gate."""

    def _init_gate(self) -> None:
        s = self.shape
        width = s.num_heads * s.head_dim if self.options.gate == "elementwise" else s.num_heads
        self.gate_proj = nn.Linear(s.hidden_size, width, bias=False)
        nn.init.zeros_(self.gate_proj.weight)

    def output_gate(self, x: Tensor) -> Tensor:
        """x: (B, T, hidden) -> gate (B, Hq, T, D) elementwise or (B, Hq, T, 1) headwise (a view, no copy)."""
        B, T, _ = x.shape
        g = torch.sigmoid(self.gate_proj(x))  # (B, T, Hq*D) or (B, T, Hq)
        return g.view(B, T, self.shape.num_heads, g.shape[-1] // self.shape.num_heads).transpose(1, 2)

    def retrofit(self) -> float:
        # gate_proj starts at zero: every gate is sigmoid(0) = 0.5 and still gets gradient.
        return 0.5 * super().retrofit()


class GatedAttention(GateMixin, AttentionVariant):
    name = "gated"
    Options = GatedOptions
    controls = ("scaled_softmax",)
    display = Display("Gated attention", OKABE_ITO["bluish_green"], "D", "-.")

    def __init__(self, shape, options=None):
        super().__init__(shape, options)
        self._init_gate()
