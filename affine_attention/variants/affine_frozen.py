"""Control: Affine-Scaled Attention with alpha frozen at a constant (no W_alpha), isolating alpha's input dependence."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .affine import AffineAttention, AffineOptions
from .base import OKABE_ITO, Display


@dataclass(frozen=True)
class AffineFrozenOptions(AffineOptions):
    frozen_alpha: float | None = 0.5  # the constant alpha; affine's own starting value, phi(0)

    def __post_init__(self):
        if self.frozen_alpha is None:
            raise ValueError("affine_frozen: option 'frozen_alpha' must be a number in [0, 1]; "
                             "for an input-dependent alpha use the 'affine' variant")
        if not math.isfinite(self.frozen_alpha) or not 0.0 <= self.frozen_alpha <= 1.0:
            raise ValueError(f"affine_frozen: option 'frozen_alpha' must lie in [0, 1] (the range of phi), "
                             f"got {self.frozen_alpha}")
        super().__post_init__()


class AffineFrozenAttention(AffineAttention):
    """Same op and alpha_ma buffer as affine (alpha_ma converges to the constant); only alpha's input dependence
    is gone, so affine minus this control measures what the input dependence buys."""

    name = "affine_frozen"
    Options = AffineFrozenOptions
    role = "control"
    controls = ()
    isolates = "the input dependence of α"
    # grey and dashed so it reads as secondary next to the real method
    display = Display("Affine-scaled (frozen α)", OKABE_ITO["grey"], "*", "--")
    retired_options = {}  # frozen_alpha is this variant's own option

    def _init_alpha(self) -> None:
        """No W_alpha: alpha is the constant frozen_alpha."""

    def initial_alpha(self) -> float:
        return self.options.frozen_alpha

    def compute_alpha(self, x: Tensor) -> Tensor:
        """x: (B, T, hidden) -> alpha: (B, Hq, T), the constant, float32 (float64 for float64 input)."""
        B, T, _ = x.shape
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        return torch.full((B, self.shape.num_heads, T), self.options.frozen_alpha, dtype=dt, device=x.device)
