"""The mean of visible V as the epilogue uses it: computed from v in forward and again in backward (never saved),
with its transpose (d m -> d v) written out for the prefix-sum masks, in place, so backward allocates only d v;
for other masks (window, documents, dense) the op differentiates the mean with autograd and the epilogue saves it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .masks import MaskSpec, visible_sum_and_count


@dataclass(frozen=True)
class ValueMean:
    """m = (sum of the values query i may see) / N_i, a linear map of v: (B, Hkv, S, D) -> (B, Hkv|Hq, T|1, D).

    Sums come from masks.visible_sum_and_count (float32, float64 for float64). bias_norm "visible" divides by N_i,
    "full" by S (an ablation).
    """

    mask: MaskSpec
    Hq: int
    bias_norm: str = "visible"

    def _denominator(self, count: Tensor) -> Tensor:
        return count.clamp(min=1) if self.bias_norm == "visible" else count.new_full((), float(max(self.mask.S, 1)))

    def __call__(self, v: Tensor) -> Tensor:
        """m, differentiable through autograd (used where the transpose below does not apply)."""
        total, count = visible_sum_and_count(v, self.mask, self.Hq)
        return total / self._denominator(count)

    def value(self, v: Tensor) -> tuple[Tensor, Tensor]:
        """(m, its denominator) without autograd, m divided in place (a fresh buffer, never v's own storage)."""
        with torch.no_grad():
            total, count = visible_sum_and_count(v, self.mask, self.Hq)
            denom = self._denominator(count)
            # Compiled graphs fuse the division anyway (and cannot inspect storage).
            if torch.compiler.is_compiling() or total.untyped_storage().data_ptr() == v.untyped_storage().data_ptr():
                return total / denom, denom
            return total.div_(denom), denom

    @property
    def has_transpose(self) -> bool:
        """True for the masks whose sums are prefix sums (none, causal with T <= S, key padding)."""
        m = self.mask
        structured = m.dense is None and m.window is None and m.documents is None
        return structured and (not m.causal or m.causal_is_trivial or m.offset >= 0)

    def transpose(self, d_m: Tensor, denom: Tensor, v: Tensor) -> Tensor:
        """d v: (B, Hkv, S, D) in v.dtype from d m: (B, Hkv, T|1, D) (overwritten), for has_transpose masks.

        Query i sees keys j <= i + S - T (all keys without a causal rule) that the key mask keeps, so
        d v_j = keep_j * sum over the queries i that see j of d m_i / N_i: a suffix sum over queries.
        """
        mk = self.mask
        B, Hkv, S, D = v.shape
        x = d_m.div_(denom)
        dv = torch.empty((B, Hkv, S, D), dtype=v.dtype, device=v.device)
        if not mk.causal or mk.causal_is_trivial:
            dv.copy_(x.sum(-2, keepdim=True).expand(B, Hkv, S, D))
        else:
            T, off = mk.T, mk.offset
            total = x.sum(-2, keepdim=True)  # (B, Hkv, 1, D): what every key up to the first query's last sees
            # Key j > off is seen by queries i >= j - off: the total less the prefix over the queries before. In
            # place, then copied into dv (in v's dtype) shifted by one row: no further buffer.
            rest = x.cumsum_(-2).neg_().add_(total)
            dv[:, :, :off + 1].copy_(total.expand(B, Hkv, off + 1, D))
            dv[:, :, off + 1:].copy_(rest[:, :, :T - 1])
        if mk.keys is not None:
            dv.mul_(mk.keys[:, :, 0, :, None])
        return dv
