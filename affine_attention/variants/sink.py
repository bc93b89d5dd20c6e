"""Attention sink (GPT-OSS): one learnable logit per query head in the softmax denominator; off-by-one fixes it at 0."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..ops import sink_attention_reference
from .base import OKABE_ITO, AttentionVariant, Display, Prologue


@dataclass(frozen=True)
class SinkOptions:
    init: float = 0.0  # initial sink logit; 0 makes the untrained sink exactly off-by-one

    def __post_init__(self):
        if not math.isfinite(self.init):  # also when built directly, not through the registry
            raise ValueError(f"sink: option 'init' must be a finite logit, got {self.init}")


# Sink logit of a function-preserving conversion. The sink scales each row by sigmoid(lse - s), which float32 rounds
# to exactly 1 once lse - s > ~17; real models have rows far below lse = 0 (SmolLM2-135M: -21.6 on a chat prompt,
# where -20 changed logits by 19 and -30 by 3e-3). -40 keeps SmolLM2 exact (0.0 on chat and plain text), while the
# logit's gradient, ~ the sink's mass exp(s - lse), stays a finite nonzero float32 (1e-16 .. 6e-23 per layer there;
# at -inf it would be 0 and the sink could never train). AdamW's step is lr * g / (|g| + eps): at the default
# eps = 1e-8 it rounds away until the mass grows, so a sink meant to train from a retrofit wants a far smaller eps.
RETROFIT_SINK_LOGIT = -40.0


class SinkAttention(AttentionVariant):
    name = "sink"
    Options = SinkOptions
    needs_lse = True
    display = Display("Attention sink", OKABE_ITO["blue"], "s", "--")
    state_stats = {"sinks": "sink logit"}

    def __init__(self, shape, options=None):
        super().__init__(shape, options)
        self.sinks = nn.Parameter(torch.full((shape.num_heads,), self.options.init))

    def adopt_model_sinks(self) -> None:
        # The model's learned sinks are exactly this variant's parameters: they stay where they are (the model's
        # `sinks`, under their checkpoint name) and reach every call as model_sinks, so none is added beside them.
        super().adopt_model_sinks()
        if "sinks" in self._parameters:
            del self._parameters["sinks"]

    def retrofit(self) -> float:
        if "sinks" not in self._parameters:
            return AttentionVariant.retrofit(self)  # the model's own sinks: already what the model computes
        with torch.no_grad():
            self.sinks.fill_(RETROFIT_SINK_LOGIT)
        return super().retrofit()

    def _sink_logits(self, device: torch.device):
        """(Hq,) this variant's own sink logits, or None when it uses the model's (see adopt_model_sinks)."""
        own = self._parameters.get("sinks")
        return None if own is None else own.to(device)

    def state_statistics(self):
        own = self._parameters.get("sinks")
        return {} if own is None else {"sinks": own}

    def prologue(self, x, token_mask):
        # The sink lives inside the kernel (its gradient needs the kernel's backward), not in the epilogue.
        return Prologue(sinks=self._sink_logits(x.device), gate=self.output_gate(x))

    def attend_reference(self, q, k, v, x, *, mask, score, sinks=None):
        if sinks is None:
            sinks = self._sink_logits(q.device).to(q.dtype)
        out, w = sink_attention_reference(q, k, v, sinks, mask=mask, score=score, enable_gqa=self._gqa)
        return out, w, {"sink_mass": 1.0 - w.sum(-1)}


class OffByOneAttention(SinkAttention):
    """Softmax with +1 in the denominator: a sink whose logit is fixed at 0.

    The zeros are made per call rather than held in a buffer: a non-persistent buffer would come back
    uninitialised whenever a model is materialised from the meta device (from_pretrained, FSDP, to_empty)."""

    name = "off_by_one"
    Options = AttentionVariant.Options
    display = Display("Off-by-one softmax", OKABE_ITO["sky_blue"], "v", ":")
    state_stats = {}  # the sink logit is a constant 0
    refuses_model_sinks = ("off_by_one adds a fixed sink of logit 0 to every softmax denominator; the model's "
                           "attention already has learned sinks, so it would have two: use 'sink' (the model's own "
                           "sinks as its parameters) or 'softmax'")
    retrofit_refusal = ("off_by_one adds a fixed +1 to every softmax denominator and has no parameter that could "
                        "start it at plain softmax, so it cannot preserve a model's function; use 'sink' (a learnable "
                        "logit that starts at a negligible mass) or function_preserving=False")

    def __init__(self, shape, options=None):
        AttentionVariant.__init__(self, shape, options)

    def _sink_logits(self, device: torch.device):
        return torch.zeros(self.shape.num_heads, device=device)  # made where it is used: no copy per layer

    def state_statistics(self):
        return {}
