"""The mean of visible V as the epilogue uses it: computed from v in forward and again in backward (never saved),
with its transpose (d m -> d v) written out for the prefix-sum masks, in place, so backward allocates only d v;
for other masks (window, documents, dense) the op differentiates the mean with autograd and the epilogue saves it.

A plain class, not a frozen dataclass, and no __call__: dynamo 2.11 cannot call a frozen dataclass instance built
inside the graph ("InternalTorchDynamoError: 'ValueMean' object has no attribute 'mask'").
"""
from __future__ import annotations

import torch
from torch import Tensor

from .masks import MaskSpec, visible_sum_and_count


class ValueMean:
    """m = (sum of the values query i may see) / N_i, a linear map of v: (B, Hkv, S, D) -> (B, Hkv|Hq, T|1, D).

    Sums come from masks.visible_sum_and_count (float32, float64 for float64). bias_norm "visible" divides by N_i,
    "full" by S (an ablation).
    """

    __slots__ = ("mask", "Hq", "bias_norm")

    def __init__(self, mask: MaskSpec, Hq: int, bias_norm: str = "visible"):
        self.mask, self.Hq, self.bias_norm = mask, Hq, bias_norm

    def __repr__(self) -> str:
        return f"ValueMean(mask={self.mask!r}, Hq={self.Hq}, bias_norm={self.bias_norm!r})"

    def _inverse(self, count: Tensor) -> Tensor:
        """1 / N, rank 4, broadcastable to the sums: (B|1, 1, T|1, 1)."""
        if self.bias_norm == "visible":
            return count.clamp(min=1).reciprocal()
        return count.new_full((1, 1, 1, 1), 1.0 / max(self.mask.S, 1))

    def of(self, v: Tensor) -> Tensor:
        """m: (B, Hkv|Hq, T|1, D), differentiable through autograd (used where the transpose below does not
        apply)."""
        total, count = visible_sum_and_count(v, self.mask, self.Hq)
        return total * self._inverse(count)

    def sum(self, v: Tensor) -> tuple[Tensor, Tensor]:
        """(total, inv) without autograd: m = total * inv. total: (B, Hkv, T|1, D) float32 (float64 for float64),
        a buffer the caller may overwrite (never v's own storage); inv: (B|1, 1, T|1, 1). The epilogue folds inv
        into its per-row coefficients, so m itself is never formed (one pass less each way)."""
        with torch.no_grad():
            total, count = visible_sum_and_count(v, self.mask, self.Hq)
            if not torch.compiler.is_compiling() and \
                    total.untyped_storage().data_ptr() == v.untyped_storage().data_ptr():
                total = total.clone()
            return total, self._inverse(count)

    @property
    def has_transpose(self) -> bool:
        """True for the masks whose sums are prefix sums (none, causal with T <= S, key padding)."""
        m = self.mask
        structured = m.dense is None and m.window is None and m.documents is None
        return structured and (not m.causal or m.causal_is_trivial or m.offset >= 0)

    def transpose(self, d_total: Tensor, v: Tensor) -> Tensor:
        """d v: (B, Hkv, S, D) in v.dtype from d_total: (B, Hkv, T|1, D), the gradient of `sum`'s total
        (overwritten), for has_transpose masks.

        Query i sees keys j <= i + S - T (all keys without a causal rule) that the key mask keeps, so
        d v_j = keep_j * (sum of d_total_i over the queries i that see j): a suffix sum over queries.
        """
        mk = self.mask
        B, Hkv, S, D = v.shape
        dv = torch.empty((B, Hkv, S, D), dtype=v.dtype, device=v.device)
        if not mk.causal or mk.causal_is_trivial:
            dv.copy_(d_total.sum(-2, keepdim=True).expand(B, Hkv, S, D))
        else:
            T, off = mk.T, mk.offset
            # Key j > off is seen by queries i >= j - off: the total less the prefix over the queries before,
            # i.e. c[-1] - c[j - off - 1] with c the prefix sums (in place), written into dv shifted by one row.
            c = d_total.cumsum_(-2)
            total = c[:, :, -1:]
            dv[:, :, :off + 1].copy_(total.expand(B, Hkv, off + 1, D))
            if torch.compiler.is_compiling():  # a compiled graph plans its own buffers (and refuses most out=)
                dv[:, :, off + 1:].copy_(total - c[:, :, :T - 1])
            else:
                torch.sub(total, c[:, :, :T - 1], out=dv[:, :, off + 1:])
        if mk.keys is not None:
            dv.mul_(mk.keys[:, :, 0, :, None])
        return dv
