"""Affine-Scaled Attention module: alpha = phi(W_alpha x) per head and query, beta from the alpha_ma buffer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..ops import affine_scaled_attention_reference
from .base import AttentionVariant, Prologue
from .gated import GateMixin, GatedOptions


def linear_clip(x: Tensor) -> Tensor:
    """The paper's best phi: 0 for x <= -5, 0.1 x + 0.5 in between, 1 for x >= 5."""
    return (0.1 * x + 0.5).clamp(0.0, 1.0)


ACTIVATIONS = {"linear_clip": linear_clip, "sigmoid": torch.sigmoid}


@dataclass(frozen=True)
class AffineOptions:
    activation: Literal["linear_clip", "sigmoid"] = "linear_clip"
    momentum: float = 0.9  # rho in alpha_ma <- rho * alpha_ma + (1 - rho) * mean(alpha)
    bias_norm: Literal["visible", "full"] = "visible"  # "full" (N = key length) is an ablation only
    # A constant alpha instead of phi(W_alpha x): the control that removes the input dependence.
    frozen_alpha: float | None = None

    def __post_init__(self):
        if not 0.0 <= self.momentum <= 1.0:
            raise ValueError(f"affine: option 'momentum' must lie in [0, 1], got {self.momentum}")
        if self.frozen_alpha is not None and not 0.0 <= self.frozen_alpha <= 1.0:
            raise ValueError(f"affine: option 'frozen_alpha' must lie in [0, 1] (the range of phi), "
                             f"got {self.frozen_alpha}")


class AffineAttention(AttentionVariant):
    """alpha_ma semantics: a per-head buffer starting at 0, updated only in training, once per forward of real
    data (a recomputation by activation checkpointing reuses the value of the original forward), from the mean of
    alpha over real tokens, averaged over data-parallel ranks so every rank holds the same value; frozen in eval.
    """

    name = "affine"
    Options = AffineOptions
    uses_value_mean = True

    def __init__(self, shape, options=None):
        super().__init__(shape, options)
        if self.options.frozen_alpha is None:
            self.alpha_proj = nn.Linear(shape.hidden_size, shape.num_heads, bias=False)
            nn.init.zeros_(self.alpha_proj.weight)  # alpha starts at phi(0) = 0.5
        self.register_buffer("alpha_ma", torch.zeros(shape.num_heads))
        self._alpha_ma_used: Tensor | None = None

    def compute_alpha(self, x: Tensor) -> Tensor:
        """x: (B, T, hidden) -> alpha: (B, Hq, T) in float32 (float64 for float64 input)."""
        B, T, _ = x.shape
        if self.options.frozen_alpha is not None:
            dt = torch.float64 if x.dtype == torch.float64 else torch.float32
            return torch.full((B, self.shape.num_heads, T), self.options.frozen_alpha, dtype=dt, device=x.device)
        pre = self.alpha_proj(x)  # (B, T, Hq)
        pre = pre.double() if x.dtype == torch.float64 else pre.float()
        return ACTIVATIONS[self.options.activation](pre).transpose(1, 2)

    def _alpha_ma_for_forward(self, alpha: Tensor, token_mask: Tensor | None) -> Tensor:
        """The alpha_ma this forward uses; in training, update the buffer first (once per real forward)."""
        if not self.training:
            return self.alpha_ma
        if torch._C._current_graph_task_id() != -1 and self._alpha_ma_used is not None:
            # Inside backward: activation checkpointing recomputing this forward. Reuse, never update again.
            return self._alpha_ma_used
        with torch.no_grad():
            a = alpha.detach().float()  # (B, Hq, T)
            if token_mask is not None:
                if token_mask.shape != (a.shape[0], a.shape[2]):
                    raise ValueError(f"token_mask must have shape (B, T) = {(a.shape[0], a.shape[2])}, "
                                     f"got {tuple(token_mask.shape)}")
                w = token_mask.to(a.dtype)[:, None, :]
                stats = torch.cat([(a * w).sum((0, 2)), w.sum().expand(1)])
            else:
                stats = torch.cat([a.sum((0, 2)), a.new_tensor([a.shape[0] * a.shape[2]])])
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(stats)  # token-weighted mean over every data-parallel rank
            mean = (stats[:-1] / stats[-1].clamp(min=1.0)).to(self.alpha_ma.dtype)
            # A batch of padding only leaves alpha_ma as it is; torch.where avoids a host sync per layer on GPU.
            new = torch.lerp(mean, self.alpha_ma, self.options.momentum)  # rho * alpha_ma + (1 - rho) * mean
            self.alpha_ma.copy_(torch.where(stats[-1] > 0, new, self.alpha_ma))
            self._alpha_ma_used = self.alpha_ma.clone()
        return self._alpha_ma_used

    def prologue(self, x, token_mask):
        alpha = self.compute_alpha(x)
        return Prologue(alpha=alpha, alpha_ma=self._alpha_ma_for_forward(alpha, token_mask),
                        gate=self.output_gate(x), bias_norm=self.options.bias_norm)

    def attend_reference(self, q, k, v, x, *, mask, scale):
        alpha = self.compute_alpha(x).to(q.dtype)
        out, w = affine_scaled_attention_reference(q, k, v, alpha, self.alpha_ma.to(q.dtype), **mask, scale=scale,
                                                   bias_norm=self.options.bias_norm, enable_gqa=self._gqa)
        return out, w, {"alpha": alpha}


@dataclass(frozen=True)
class AffineGatedOptions(AffineOptions, GatedOptions):
    """Options of both affine and gated."""


class AffineGatedAttention(GateMixin, AffineAttention):
    """Affine-Scaled attention whose output then passes the sigmoid gate."""

    name = "affine_gated"
    Options = AffineGatedOptions

    def __init__(self, shape, options=None):
        super().__init__(shape, options)
        self._init_gate()
