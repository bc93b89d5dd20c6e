"""Where attention weight goes: on the first token, on the other tokens (per query, per head, as a layer x head
grid) and its histogram; the paper's sink and head-utilisation diagnostics. Layouts as in attention_rows."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .attention_rows import (bin_counts, check_query_mask, check_rows, check_weights, expand_visible,
                             first_key_weight, head_sums, histogram_edges, prepare, ratio, row_total, shape_of,
                             sink_normalise)

__all__ = ["first_token_mass", "total_mass", "mean_total_mass", "head_utilisation", "mass_histogram"]


def first_token_mass(w: Tensor, visible: Tensor | None = None, query_mask: Tensor | None = None) -> Tensor:
    """Mean weight on the first token, per head.

    Layout: w (B, H, T, S); visible (B|1, H|1, T, S) bool or None; query_mask (B, T) bool or None -> (H,) float64.

    Definition: for each real query i of sequence b in head h let f(b, h, i) = min{ j : visible[b, h, i, j] },
    the first key the query may see. Then

        first_token_mass[h] = mean over real (b, i) of w[b, h, i, f(b, h, i)].

    Without padding f = 0 (key 0). Under left padding the first visible key is the first real token of the
    sequence, so the metric measures the same thing in padded and unpadded batches. Padded queries
    (query_mask False) and queries that see no key are excluded. The value is the raw weight: it may exceed 1 or
    be negative for affine rows; for sink variants it is the weight on the first token, never the sink.
    """
    w, vis, real = prepare(w, visible, query_mask)
    return ratio(*head_sums(first_key_weight(w, vis), real))


def total_mass(w: Tensor, visible: Tensor | None = None, exclude_first: bool = True) -> Tensor:
    """Per-query total attention mass over non-sink tokens (the paper's histogram quantity).

    Layout: w (B, H, T, S); visible (B|1, H|1, T, S) bool or None -> (B, H, T), same dtype/device as w (>= float32).

    Definition: total[b, h, i] = sum_{j visible} w[b, h, i, j]  -  [exclude_first] * w[b, h, i, f(b, h, i)],
    with f the first visible key (see `first_token_mass`): the first token is the emergent attention-sink token,
    so it is left out by default. Signed sum: negative affine entries reduce the total. The learned sink of sink
    variants is not a key, so its mass is never included (a sink row over keys sums to 1 - sink mass). Rows that
    see no key give 0. Every query is returned, padded ones included: filter with query_mask when reducing.
    """
    w = check_weights(w, "w")
    return row_total(w, expand_visible(visible, w.shape, w.device), exclude_first)


def mean_total_mass(w: Tensor, visible: Tensor | None = None, query_mask: Tensor | None = None,
                    sink_mass: Tensor | None = None, *, exclude_first: bool = True,
                    sink_excluded: bool = True) -> Tensor:
    """Per-head mean total mass: one row of the paper's layer x head utilisation heatmap (the paper's diagnostic 4).

    Layout: w (B, H, T, S); visible (B|1, H|1, T, S); query_mask (B, T); sink_mass (B, H, T) or None -> (H,) float64.

    Definition: m[b, h, i] = total_mass(w, visible, exclude_first)[b, h, i]. If sink_mass is given and
    sink_excluded is True the sink's share is taken out of the denominator:

        m[b, h, i] <- m[b, h, i] / (1 - sink_mass[b, h, i]),

    i.e. the fraction of the mass that went to keys at all which lands on non-first tokens (queries with
    1 - sink_mass <= 1e-12 put nothing on keys and are excluded). Without sink_mass, or with sink_excluded=False,
    m is the raw total. Result[h] = mean of m over real queries (padding and key-less queries excluded).
    """
    w, vis, real = prepare(w, visible, query_mask)
    m = row_total(w, vis, exclude_first)
    if sink_mass is not None:
        B, H, T, _ = w.shape
        sink = check_rows(sink_mass, "sink_mass", B, H, T, w.device)
        if sink_excluded:
            m, ok = sink_normalise(m, sink)
            real = real & ok
    return ratio(*head_sums(m, real))


def head_utilisation(masses: Tensor | Sequence[Tensor]) -> Tensor:
    """Layer x head grid of mean total mass, min-max normalised to [0, 1] over the whole grid.

    Layout: masses (L, H) float, or a sequence of L per-layer (H,) tensors (e.g. from `mean_total_mass`)
    -> (L, H) float64.

    Definition: u[l, h] = (m[l, h] - min m) / (max m - min m), min and max taken over all finite entries of the
    L x H grid (one scale for the whole model, so layers stay comparable). A constant grid (max == min, or fewer
    than two finite entries) gives zeros rather than NaN. Non-finite entries (heads that saw no real query)
    stay NaN.
    """
    if isinstance(masses, (list, tuple)):
        masses = torch.stack([torch.as_tensor(m) for m in masses]) if masses else torch.empty(0)
    if not isinstance(masses, Tensor) or masses.dim() != 2:
        got = shape_of(masses) if isinstance(masses, Tensor) else type(masses).__name__
        raise ValueError(f"masses must have shape (L, H) (or be a list of (H,) tensors), got {got}")
    m = masses.to("cpu", torch.float64)
    finite = torch.isfinite(m)
    out = torch.full_like(m, float("nan"))
    if not finite.any():
        return out
    lo, hi = m[finite].min(), m[finite].max()
    span = hi - lo
    scaled = (m - lo) / span if span > 0 else torch.zeros_like(m)
    return torch.where(finite, scaled, out)


def mass_histogram(total: Tensor, query_mask: Tensor | None = None, bins: int | Sequence[float] | Tensor = 50,
                   value_range: tuple[float, float] = (0.0, 1.0)) -> tuple[Tensor, Tensor]:
    """Histogram of per-query total mass across real queries and heads (the paper's diagnostic 2).

    Layout: total (B, H, T) float (from `total_mass`); query_mask (B, T) or (B, H, T) bool or None
    -> (counts (n,) int64, edges (n+1,) float64).

    `bins` is a number of equal bins over value_range or explicit increasing edges. Bin k is
    [edges[k], edges[k+1]); values below edges[0] go to the first bin and values >= edges[-1] to the last, so
    every real query is counted exactly once (counts.sum() == number of real (b, h, i)). NaN values are dropped.
    """
    if not isinstance(total, Tensor) or total.dim() != 3:
        got = shape_of(total) if isinstance(total, Tensor) else type(total).__name__
        raise ValueError(f"total must have shape (B, H, T), got {got}")
    B, H, T = total.shape
    if isinstance(query_mask, Tensor) and query_mask.dim() == 3:
        if query_mask.dtype != torch.bool or shape_of(query_mask) != (B, H, T):
            raise ValueError(f"query_mask must be bool of shape ({B}, {T}) or ({B}, {H}, {T}), "
                             f"got {shape_of(query_mask)}")
        valid = query_mask
    else:
        valid = check_query_mask(query_mask, B, T, total.device)[:, None, :].expand(B, H, T)
    edges = histogram_edges(bins, value_range)
    return bin_counts(total, valid, edges), edges
