"""Affine-Scaled Attention module: alpha = phi(W_alpha x) per head and query, beta from the alpha_ma buffer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from .._compat import as_dtype
from ..ops import affine_scaled_attention_reference
from . import running_stats
from .base import OKABE_ITO, AttentionVariant, Display, Prologue
from .gated import GateMixin, GatedOptions


def linear_clip(x: Tensor) -> Tensor:
    """The paper's best phi: 0 for x <= -5, 0.1 x + 0.5 in between, 1 for x >= 5."""
    return (0.1 * x + 0.5).clamp(0.0, 1.0)


ACTIVATIONS = {"linear_clip": linear_clip, "sigmoid": torch.sigmoid}
# alpha in [0, 1] is accumulated as round(alpha * 2**32) in int64: 2**31 tokens per step before overflow.
ALPHA_FIXED_POINT = 2.0 ** 32


@dataclass(frozen=True)
class AffineOptions:
    activation: Literal["linear_clip", "sigmoid"] = "linear_clip"
    momentum: float = 0.9  # rho in alpha_ma <- rho * alpha_ma + (1 - rho) * mean(alpha)
    bias_norm: Literal["visible", "full"] = "visible"  # "full" (N = key length) is an ablation only

    def __post_init__(self):
        if not 0.0 <= self.momentum <= 1.0:
            raise ValueError(f"affine: option 'momentum' must lie in [0, 1], got {self.momentum}")


class AffineAttention(AttentionVariant, running_stats.RunningStats):
    """alpha_ma semantics: a per-head buffer starting at 0, frozen in eval, used as it is by every forward of an
    optimizer step. In training each forward only adds alpha over its real tokens to `alpha_acc` (a recomputation
    by activation checkpointing adds nothing); `affine_attention.step_running_stats(model)`, once per optimizer
    step, sums the accumulators over the data-parallel group and applies one EMA step to the token-weighted mean.
    So every parallel layout (ranks x micro-batches) of the same tokens gives the same alpha_ma on every rank.
    """

    name = "affine"
    Options = AffineOptions
    uses_value_mean = True
    role = "method"
    controls = ("affine_frozen", "scaled_softmax")
    display = Display("Affine-scaled", OKABE_ITO["vermillion"], "^", "-")
    token_stats = {"alpha": "α"}
    state_stats = {"alpha_ma": "α moving average"}
    # Saved before the frozen-alpha control became its own variant (affine_frozen): dropped when the value is this.
    retired_options = {"frozen_alpha": None}
    refuses_model_sinks = ("the affine bias beta = (alpha_ma - alpha) / N makes each query's weights sum to alpha_ma "
                           "only when the softmax weights sum to one; the model's learned sinks take part of that "
                           "mass, so the result would not be the paper's method: convert a model without sinks")

    def __init__(self, shape, options=None):
        super().__init__(shape, options)
        self._init_alpha()
        self.register_buffer("alpha_ma", torch.zeros(shape.num_heads))
        # (Hq + 1,) int64: per head the sum of round(alpha * 2**32) over the real tokens seen since the last step,
        # then their count. Integers: exact and order-independent (any layout sums to the same bits), untouched by
        # `model.to(dtype)`. Persistent, so a checkpoint round trip never leaves it uninitialised (meta loading).
        self.register_buffer("alpha_acc", torch.zeros(shape.num_heads + 1, dtype=torch.int64))
        running_stats.watch(self)

    def _init_alpha(self) -> None:
        """W_alpha: hidden -> Hq, no bias, zero init, so alpha starts at phi(0) = 0.5."""
        self.alpha_proj = nn.Linear(self.shape.hidden_size, self.shape.num_heads, bias=False)
        nn.init.zeros_(self.alpha_proj.weight)

    def initial_alpha(self) -> float:
        """alpha at initialisation, for every token: phi(0) (linear_clip(0) = sigmoid(0) = 0.5)."""
        return 0.5

    def compute_alpha(self, x: Tensor) -> Tensor:
        """x: (B, T, hidden) -> alpha: (B, Hq, T) in float32 (float64 for float64 input)."""
        pre = self.alpha_proj(x)  # (B, T, Hq)
        pre = as_dtype(pre, torch.float64 if x.dtype == torch.float64 else torch.float32)
        return ACTIVATIONS[self.options.activation](pre).transpose(1, 2)

    def _alpha_ma_for_forward(self, alpha: Tensor, token_mask: Tensor | None) -> Tensor:
        """The alpha_ma this forward uses (the buffer, unchanged); in training, accumulate alpha's statistic."""
        if self.training and not running_stats.recomputing():
            self.accumulate_alpha(alpha, token_mask)
        return self.alpha_ma

    @torch.no_grad()
    def accumulate_alpha(self, alpha: Tensor, token_mask: Tensor | None = None) -> None:
        """alpha: (B, Hq, T); token_mask: (B, T) bool, True on real tokens (None: every token is real)."""
        B, _, T = alpha.shape
        fixed = torch.round(alpha.detach() * ALPHA_FIXED_POINT).to(torch.int64)  # exact: alpha lies in [0, 1]
        if token_mask is not None:
            if token_mask.shape != (B, T):
                raise ValueError(f"token_mask must have shape (B, T) = {(B, T)}, got {tuple(token_mask.shape)}")
            w = token_mask.to(torch.int64)
            stats = torch.cat([(fixed * w[:, None, :]).sum((0, 2)), w.sum().reshape(1)])
        else:
            stats = torch.cat([fixed.sum((0, 2)), fixed.new_full((1,), B * T)])
        self.alpha_acc.add_(stats)

    @torch.no_grad()
    def apply_running_stats(self, acc: Tensor) -> None:
        """acc: (Hq + 1,) int64, this layer's `alpha_acc` summed over the data-parallel group. One EMA step
        alpha_ma <- rho * alpha_ma + (1 - rho) * mean(alpha) where any real token was seen; then the local
        accumulator restarts at zero. No host sync (torch.where instead of a Python branch)."""
        ma = self.alpha_ma
        dt = torch.float32 if ma.device.type == "mps" else torch.float64
        acc = acc.to(ma.device)
        count = acc[-1]
        mean = acc[:-1].to(dt) / (count.clamp(min=1).to(dt) * ALPHA_FIXED_POINT)
        new = torch.lerp(mean, ma.to(dt), self.options.momentum)
        ma.copy_(torch.where(count > 0, new, ma.to(dt)))
        self.alpha_acc.zero_()

    def running_accumulator(self) -> Tensor:
        return self.alpha_acc

    def token_statistics(self, x):
        return {"alpha": self.compute_alpha(x)}

    def state_statistics(self):
        return {"alpha_ma": self.alpha_ma}

    @property
    def value_mean_norm(self) -> str:
        return self.options.bias_norm

    def retrofit(self) -> float:
        """alpha starts at a constant a (initial_alpha); with alpha_ma = a the bias term vanishes, so the output is
        a * softmax attention. alpha_proj (zero) still gets gradient through alpha * (Attn - mean V)."""
        a = self.initial_alpha()
        if a <= 0:
            raise ValueError(f"{self.name}: frozen_alpha = {a} scales attention to zero, so no conversion can "
                             "preserve the model's function; use frozen_alpha > 0 or function_preserving=False")
        with torch.no_grad():
            self.alpha_ma.fill_(a)
        return a * super().retrofit()

    def retrofit_weight_scale(self) -> float:
        return self.initial_alpha()  # a_ij = alpha p_ij + beta with beta = 0 at the start

    def prologue(self, x, token_mask):
        alpha = self.compute_alpha(x)
        return Prologue(alpha=alpha, alpha_ma=self._alpha_ma_for_forward(alpha, token_mask),
                        gate=self.output_gate(x), bias_norm=self.options.bias_norm)

    def attend_reference(self, q, k, v, x, *, mask, score, sinks=None):
        alpha = self.compute_alpha(x).to(q.dtype)
        out, w = affine_scaled_attention_reference(q, k, v, alpha, self.alpha_ma.to(q.dtype), mask=mask, score=score,
                                                   bias_norm=self.options.bias_norm, enable_gqa=self._gqa)
        return out, w, {"alpha": alpha}


@dataclass(frozen=True)
class AffineGatedOptions(AffineOptions, GatedOptions):
    """Options of both affine and gated."""


class AffineGatedAttention(GateMixin, AffineAttention):
    """Affine-Scaled attention whose output then passes the sigmoid gate."""

    name = "affine_gated"
    Options = AffineGatedOptions
    controls = ("scaled_softmax",)
    display = Display("Affine-scaled + gated", OKABE_ITO["reddish_purple"], "P", (0, (5, 1)))

    def __init__(self, shape, options=None):
        super().__init__(shape, options)
        self._init_gate()
