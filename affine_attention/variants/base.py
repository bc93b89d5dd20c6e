"""The module-side contract every attention variant follows; softmax is the base and the others override pieces."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

from ..ops import softmax_attention, softmax_attention_reference


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


class AttentionVariant(nn.Module):
    """Softmax attention; subclasses override `attend`/`attend_reference` and `finish` for what differs.

    forward(q, k, v, x) takes q: (B, Hq, T, D), k, v: (B, Hkv, S, D), the layer's input hidden states
    x: (B, T, hidden) (after the pre-norm: alpha and gates are computed from it) and returns (B, Hq, T, D),
    ready for the output projection. token_mask: (B, T) bool, True on real tokens (statistics skip padding).
    """

    name: ClassVar[str] = "softmax"
    Options: ClassVar[type] = NoOptions
    #: True when the variant wants the mean of visible V (decoding keeps a running sum for it).
    uses_value_mean: ClassVar[bool] = False

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
        out = self.attend(q, k, v, x, mask=mask, scale=scale, token_mask=token_mask, v_mean=v_mean,
                          backend=backend)
        return self.finish(out, x)

    def reference(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, *, attn_mask: Tensor | None = None,
                  is_causal: bool = False, window: int | None = None, document_ids: Tensor | None = None,
                  scale: float | None = None) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """Eager form for analysis: (out (B, Hq, T, D), weights (B, Hq, T, S), extras such as alpha or sink mass).

        Never updates state (alpha_ma stays as it is)."""
        self._check_x(x, q)
        mask = dict(attn_mask=attn_mask, is_causal=is_causal, window=window, document_ids=document_ids)
        out, w, extras = self.attend_reference(q, k, v, x, mask=mask, scale=scale)
        return self.finish(out, x), w, extras

    # --- what subclasses override -------------------------------------------------------------
    # mask: the op keywords attn_mask, is_causal, window, document_ids, passed on unchanged.
    def attend(self, q, k, v, x, *, mask: dict[str, Any], scale, token_mask, v_mean, backend) -> Tensor:
        return softmax_attention(q, k, v, **mask, scale=scale, enable_gqa=self._gqa, backend=backend)

    def attend_reference(self, q, k, v, x, *, mask: dict[str, Any], scale):
        out, w = softmax_attention_reference(q, k, v, **mask, scale=scale, enable_gqa=self._gqa)
        return out, w, {}

    def finish(self, out: Tensor, x: Tensor) -> Tensor:
        """Post-attention transform of out: (B, Hq, T, D); identity for softmax."""
        return out

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
