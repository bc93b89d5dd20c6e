"""The module-side contract every attention variant follows; softmax is the base and the others override pieces."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

from ..ops import softmax_attention_reference
from ..ops.affine import attention_with_epilogue


@dataclass(frozen=True)
class AttentionShape:
    """Sizes of one attention layer: hidden (model width), query heads, key/value heads, head dim."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"AttentionShape.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")


@dataclass(frozen=True)
class NoOptions:
    """Variants without options."""


@dataclass(frozen=True)
class Prologue:
    """What a variant's prologue computes from the layer input before the kernel runs; None = not used.

    alpha: (B, Hq, T) with alpha_ma: (Hq,) (the affine part; needs the mean of visible V); gate: broadcastable to
    (B, Hq, T, D) or a float, applied in the epilogue; sinks: (Hq,) logits, applied inside the kernel (needs its
    lse); bias_norm: how the affine bias term counts keys.
    """

    alpha: Tensor | None = None
    alpha_ma: Tensor | None = None
    gate: Tensor | float | None = None
    sinks: Tensor | None = None
    bias_norm: str = "visible"


class AttentionVariant(nn.Module):
    """Softmax attention; subclasses override `prologue`, `output_gate` and `attend_reference` for what differs.

    The fast path is one call: prologue (alpha, gate, sinks from x) -> softmax kernel (the sink inside it) -> one
    epilogue pass (affine combine and gate together, ops/epilogue.py). `needs_lse` and `uses_value_mean` declare
    what the variant needs from the kernel; forward checks the prologue against them.

    forward(q, k, v, x) takes q: (B, Hq, T, D), k, v: (B, Hkv, S, D), the layer's input hidden states
    x: (B, T, hidden) (after the pre-norm: alpha and gates are computed from it) and returns (B, Hq, T, D),
    ready for the output projection. token_mask: (B, T) bool, True on real tokens (statistics skip padding).
    """

    name: ClassVar[str] = "softmax"
    Options: ClassVar[type] = NoOptions
    #: True when the variant wants the mean of visible V (decoding keeps a running sum for it).
    uses_value_mean: ClassVar[bool] = False
    #: True when the variant needs the kernel's log-sum-exp (a sink).
    needs_lse: ClassVar[bool] = False

    def __init__(self, shape: AttentionShape, options=None):
        super().__init__()
        self.shape = shape
        self.options = options if options is not None else self.Options()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, *, attn_mask: Tensor | None = None,
                is_causal: bool = False, window: int | None = None, document_ids: Tensor | None = None,
                scale: float | None = None, token_mask: Tensor | None = None, v_mean: Tensor | None = None,
                backend: str | None = None) -> Tensor:
        """window / document_ids ((B, S) int) / backend: as on the ops (see affine_attention.ops)."""
        self._check_x(x, q)
        mask = dict(attn_mask=attn_mask, is_causal=is_causal, window=window, document_ids=document_ids)
        return self.attend(q, k, v, x, mask=mask, scale=scale, token_mask=token_mask, v_mean=v_mean,
                           backend=backend)

    def reference(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, *, attn_mask: Tensor | None = None,
                  is_causal: bool = False, window: int | None = None, document_ids: Tensor | None = None,
                  scale: float | None = None) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """Eager form for analysis: (out (B, Hq, T, D), weights (B, Hq, T, S), extras such as alpha or sink mass).

        Never updates state (alpha_ma stays as it is)."""
        self._check_x(x, q)
        mask = dict(attn_mask=attn_mask, is_causal=is_causal, window=window, document_ids=document_ids)
        out, w, extras = self.attend_reference(q, k, v, x, mask=mask, scale=scale)
        gate = self.output_gate(x)  # the readable form of the epilogue's gate: one multiply
        return (out if gate is None else out * gate), w, extras

    # --- what subclasses override -------------------------------------------------------------
    def prologue(self, x: Tensor, token_mask: Tensor | None) -> Prologue:
        """Per-token inputs from x: (B, T, hidden); called once per forward (it may step running statistics)."""
        return Prologue(gate=self.output_gate(x))

    def output_gate(self, x: Tensor) -> Tensor | float | None:
        """The epilogue's output gate from x: (B, T, hidden), broadcastable to (B, Hq, T, D); None for softmax."""
        return None

    # mask: the op keywords attn_mask, is_causal, window, document_ids, passed on unchanged.
    def attend(self, q, k, v, x, *, mask: dict[str, Any], scale, token_mask, v_mean, backend) -> Tensor:
        p = self.prologue(x, token_mask)
        if (p.sinks is not None) != self.needs_lse or (p.alpha is not None) != self.uses_value_mean:
            raise ValueError(f"variant {self.name!r}: its prologue does not match what it declares it needs from "
                             f"the kernel (needs_lse={self.needs_lse}, uses_value_mean={self.uses_value_mean})")
        return attention_with_epilogue(q, k, v, alpha=p.alpha, alpha_ma=p.alpha_ma, gate=p.gate, sinks=p.sinks,
                                       **mask, scale=scale, bias_norm=p.bias_norm, enable_gqa=self._gqa,
                                       backend=backend, v_mean=v_mean if p.alpha is not None else None)

    def attend_reference(self, q, k, v, x, *, mask: dict[str, Any], scale):
        out, w = softmax_attention_reference(q, k, v, **mask, scale=scale, enable_gqa=self._gqa)
        return out, w, {}

    # --- helpers ------------------------------------------------------------------------------
    @property
    def _gqa(self) -> bool:
        return self.shape.num_heads != self.shape.num_kv_heads

    def _check_x(self, x: Tensor, q: Tensor) -> None:
        B, Hq, T, _ = q.shape
        if x.dim() != 3 or x.shape[0] != B or x.shape[1] != T or x.shape[2] != self.shape.hidden_size:
            raise ValueError(f"x (the attention input) must have shape (B, T, hidden) = "
                             f"{(B, T, self.shape.hidden_size)}, got {tuple(x.shape)}")
        if Hq != self.shape.num_heads:
            raise ValueError(f"q has {Hq} heads, this {self.name} layer was built for {self.shape.num_heads}")

    def extra_repr(self) -> str:
        return f"variant={self.name!r}, options={self.options}"
