"""`LayerStats`: one layer's attention diagnostics accumulated chunk by chunk (batches or query blocks), so no
caller holds every layer's weights at once; equal to the one-shot metrics on all the data."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .attention_rows import (bin_counts, check_rows, first_key_weight, head_sums, histogram_edges, prepare, ratio,
                             row_entropy, row_total, shape_of, sink_normalise)

__all__ = ["LayerStats"]


def _default_edges() -> Tensor:
    return torch.linspace(0.0, 1.0, 51, dtype=torch.float64)


@dataclass
class LayerStats:
    """Running per-head statistics of one layer's attention, fed chunk by chunk (batches or query blocks).

    Call `update(w, visible, query_mask, sink_mass)` with any split of the data along batch or query positions
    (every metric is per query, so a chunk of queries (B, H, Tc, S) with visible (B|1, H|1, Tc, S) and
    query_mask (B, Tc) is fine); `result()` equals the one-shot functions applied to all the data at once:
      "first_token_mass" (H,)                `first_token_mass`
      "entropy" (H,)                         `attention_entropy` (with sink_mass when given)
      "mean_total_mass" (H,)                 `mean_total_mass(..., sink_excluded=False)`: raw total mass
      "mean_total_mass_sink_excluded" (H,)   `mean_total_mass(..., sink_excluded=True)` (= the raw one without sink)
      "hist_counts" (H, n) int64, "hist_edges" (n+1,)  `mass_histogram` of the raw total, kept per head
                                             (sum over dim 0 for the pooled histogram)
      "n_queries" (H,) int64                 real queries seen per head.
    Sums are kept in float64 on the CPU, so memory is O(H * n) whatever the amount of data.
    """

    hist_edges: Tensor | int = field(default_factory=_default_edges)
    exclude_first: bool = True
    _acc: dict = field(default_factory=dict, init=False, repr=False)
    _num_heads: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.hist_edges = histogram_edges(self.hist_edges, (0.0, 1.0))  # an int means that many bins over [0, 1]

    def update(self, w: Tensor, visible: Tensor | None = None, query_mask: Tensor | None = None,
               sink_mass: Tensor | None = None) -> None:
        """Add one chunk: w (B, H, T, S), visible (B|1, H|1, T, S), query_mask (B, T), sink_mass (B, H, T)."""
        w, vis, real = prepare(w, visible, query_mask)
        B, H, T, _ = w.shape
        if self._num_heads is not None and H != self._num_heads:
            raise ValueError(f"w must have {self._num_heads} heads like earlier updates, got shape {shape_of(w)}")
        self._num_heads = H
        sink = check_rows(sink_mass, "sink_mass", B, H, T, w.device) if sink_mass is not None else None

        total = row_total(w, vis, self.exclude_first)
        ent, defined = row_entropy(w, vis, sink)
        normed, ok = sink_normalise(total, sink) if sink is not None else (total, real)
        self._add("first", *head_sums(first_key_weight(w, vis), real))
        self._add("entropy", *head_sums(ent, real & defined))
        self._add("total", *head_sums(total, real))
        self._add("total_se", *head_sums(normed, real & ok))
        hist = torch.stack([bin_counts(total[:, h], real[:, h], self.hist_edges) for h in range(H)])
        self._acc["hist"] = self._acc["hist"] + hist if "hist" in self._acc else hist

    def _add(self, key: str, sums: Tensor, counts: Tensor) -> None:
        if key in self._acc:
            s, c = self._acc[key]
            sums, counts = s + sums, c + counts
        self._acc[key] = (sums, counts)

    def result(self) -> dict:
        """Per-head results (see the class docstring); RuntimeError before the first update."""
        if self._num_heads is None:
            raise RuntimeError("LayerStats.result() called before any update()")
        return {
            "first_token_mass": ratio(*self._acc["first"]),
            "entropy": ratio(*self._acc["entropy"]),
            "mean_total_mass": ratio(*self._acc["total"]),
            "mean_total_mass_sink_excluded": ratio(*self._acc["total_se"]),
            "hist_counts": self._acc["hist"].clone(),
            "hist_edges": self.hist_edges.clone(),
            "n_queries": self._acc["total"][1].clone(),
        }
