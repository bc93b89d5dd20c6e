"""Control: Affine-Scaled Attention with alpha frozen at a constant (no W_alpha), isolating alpha's input dependence."""
from __future__ import annotations

from dataclasses import dataclass

from .affine import AffineAttention, AffineOptions
from .base import OKABE_ITO, Display


@dataclass(frozen=True)
class AffineFrozenOptions(AffineOptions):
    frozen_alpha: float | None = 0.5  # affine's own starting value, phi(0)

    def __post_init__(self):
        if self.frozen_alpha is None:
            raise ValueError("affine_frozen: option 'frozen_alpha' must be a number in [0, 1]; "
                             "for an input-dependent alpha use the 'affine' variant")
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
