"""Scalable softmax (SSMax, Nakanishi 2025): each query's logits times s * log N + b, N the keys it sees, s and b
learnable per head, so attention does not flatten as N grows. A user of the score hook: no kernel of its own."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..ops.call import AttentionCall, Score
from .base import AttentionVariant, Display


@dataclass(frozen=True)
class SSMaxOptions:
    s_init: float = 1 / math.log(1024)  # logits unchanged where a query sees 1024 keys
    b_init: float = 0.0  # SSMax with bias (the paper's variant); 0: plain SSMax

    def __post_init__(self):
        for name in ("s_init", "b_init"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"ssmax: option {name!r} must be a finite number, got {getattr(self, name)}")


class ScalableSoftmaxAttention(AttentionVariant):
    name = "ssmax"
    Options = SSMaxOptions
    role = "baseline"
    display = Display("Scalable softmax (SSMax)", "#332288", "p", (0, (2, 1)))  # Tol muted indigo
    state_stats = {"ssmax_s": "SSMax s"}

    def __init__(self, shape, options=None):
        super().__init__(shape, options)
        self.s = nn.Parameter(torch.full((shape.num_heads,), float(self.options.s_init)))
        self.b = nn.Parameter(torch.full((shape.num_heads,), float(self.options.b_init)))

    def score(self, call: AttentionCall, x: Tensor) -> Score:
        """The call's logits times m = s log N + b: (B|1, Hq, T) per head and query."""
        n = call.visible_counts(self.s.dtype).clamp(min=1)  # a query that sees nothing: any factor, log 1 = 0
        m = self.s[None, :, None] * torch.log(n) + self.b[None, :, None]
        return call.score.with_q_scale(m)

    def state_statistics(self):
        return {"ssmax_s": self.s}

    def retrofit(self) -> float:
        """s = 0, b = 1: every logit unchanged, so the output is softmax's; s still gets gradient (through log N)."""
        with torch.no_grad():
            self.s.zero_()
            self.b.fill_(1.0)
        return super().retrofit()
