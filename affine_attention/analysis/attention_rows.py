"""Validation of attention weights and masks, and the per-query reductions every attention metric shares
(mass_metrics, pattern_metrics, scale_metrics, layer_stats)."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "SINK_EPS",
    "shape_of",
    "check_weights",
    "expand_visible",
    "check_query_mask",
    "check_rows",
    "prepare",
    "real_queries",
    "first_key_weight",
    "row_total",
    "sink_normalise",
    "row_entropy",
    "head_sums",
    "ratio",
    "histogram_edges",
    "bin_counts",
]

# Layouts shared by every metric (each function states its own too):
#   w           (B, H, T, S) float     attention weights over keys (softmax p, sink weights, affine
#                                      a = alpha*p + beta). Affine rows need not sum to one and may be negative;
#                                      sink rows sum to 1 - sink mass.
#   visible     (B|1, H|1, T, S) bool  True = query i may attend key j. Entries of `w` where it is False are
#                                      ignored (treated as 0), whatever they hold (0, NaN, garbage). None = all
#                                      visible.
#   query_mask  (B, T) bool            True = real (non-padding) query. None = all real.
#   sink_mass   (B, H, T) float        weight given to the learned sink (1 - sum of key weights), sink variants only.
# A *real query* is one with query_mask True and at least one visible key; only real queries enter any mean.
# Per-head results are float64 CPU tensors; a head without any real query gives NaN.

SINK_EPS = 1e-12  # queries whose key share 1 - sink_mass is below this carry no key mass to normalise


# ---------------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------------
def shape_of(x: Tensor) -> tuple:
    return tuple(x.shape)


def check_weights(x, name: str) -> Tensor:
    """A floating (B, H, T, S) tensor; half precisions are upcast to float32 so sums stay accurate."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape (B, H, T, S), got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have shape (B, H, T, S), got shape {shape_of(x)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor of shape (B, H, T, S), got dtype {x.dtype}")
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def expand_visible(visible, shape: tuple, device) -> Tensor:
    """visible (B|1, H|1, T, S) bool -> expanded view of shape (B, H, T, S); None -> all True."""
    B, H, T, S = shape
    if visible is None:
        return torch.ones((1, 1, T, S), dtype=torch.bool, device=device).expand(B, H, T, S)
    if not isinstance(visible, Tensor):
        raise ValueError(f"visible must be a bool torch.Tensor of shape ({B}|1, {H}|1, {T}, {S})")
    if visible.dtype != torch.bool:
        raise ValueError(f"visible must be a bool tensor (True = may attend), got dtype {visible.dtype}")
    if (visible.dim() != 4 or visible.shape[0] not in (1, B) or visible.shape[1] not in (1, H)
            or tuple(visible.shape[2:]) != (T, S)):
        raise ValueError(f"visible must have shape ({B}|1, {H}|1, {T}, {S}), got shape {shape_of(visible)}")
    return visible.to(device).expand(B, H, T, S)


def check_query_mask(query_mask, B: int, T: int, device) -> Tensor:
    """query_mask (B, T) bool -> itself; None -> all True."""
    if query_mask is None:
        return torch.ones((B, T), dtype=torch.bool, device=device)
    if not isinstance(query_mask, Tensor) or query_mask.dtype != torch.bool:
        raise ValueError(f"query_mask must be a bool torch.Tensor of shape ({B}, {T})")
    if shape_of(query_mask) != (B, T):
        raise ValueError(f"query_mask must have shape ({B}, {T}), got shape {shape_of(query_mask)}")
    return query_mask.to(device)


def check_rows(x, name: str, B: int, H: int, T: int, device) -> Tensor:
    """A per-query float tensor (B, H, T), e.g. sink_mass."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating torch.Tensor of shape ({B}, {H}, {T})")
    if shape_of(x) != (B, H, T):
        raise ValueError(f"{name} must have shape ({B}, {H}, {T}), got shape {shape_of(x)}")
    return x.to(device)


# ---------------------------------------------------------------------------------------------------------------
# per-query kernels: (B, H, T, S) -> (B, H, T); shared by the one-shot functions and LayerStats
# ---------------------------------------------------------------------------------------------------------------
def real_queries(vis: Tensor, qmask: Tensor) -> Tensor:
    """(B, H, T) bool: query is real (query_mask) and sees at least one key."""
    return vis.any(-1) & qmask[:, None, :]


def first_key_weight(w: Tensor, vis: Tensor) -> Tensor:
    """(B, H, T): weight on each query's first visible key (0 for rows that see nothing)."""
    S = w.shape[-1]
    pos = torch.arange(S, device=w.device)
    first = torch.where(vis, pos, S).amin(-1)  # S when nothing is visible
    val = w.gather(-1, first.clamp(max=S - 1).unsqueeze(-1)).squeeze(-1)
    return torch.where(first < S, val, torch.zeros_like(val))


def row_total(w: Tensor, vis: Tensor, exclude_first: bool) -> Tensor:
    """(B, H, T): sum of weights over visible keys, minus the first visible key's weight if exclude_first."""
    total = torch.where(vis, w, torch.zeros_like(w)).sum(-1)
    return total - first_key_weight(w, vis) if exclude_first else total


def sink_normalise(total: Tensor, sink: Tensor) -> tuple[Tensor, Tensor]:
    """total / (1 - sink) and where that is defined (1 - sink > eps)."""
    share = 1.0 - sink.to(total.dtype)
    ok = share > SINK_EPS
    return total / torch.where(ok, share, torch.ones_like(share)), ok


def row_entropy(w: Tensor, vis: Tensor, sink: Tensor | None) -> tuple[Tensor, Tensor]:
    """(B, H, T) entropy in nats of |w| renormalised over visible keys (+ |sink| as one outcome); defined where Z > 0."""
    a = torch.where(vis, w, torch.zeros_like(w)).abs()
    z = a.sum(-1)
    s = sink.to(a.dtype).abs() if sink is not None else None
    if s is not None:
        z = z + s
    defined = z > 0
    zs = torch.where(defined, z, torch.ones_like(z))
    q = a / zs.unsqueeze(-1)
    ent = -torch.special.xlogy(q, q).sum(-1)  # xlogy(0, 0) = 0
    if s is not None:
        qs = s / zs
        ent = ent - torch.special.xlogy(qs, qs)
    return torch.where(defined, ent, torch.zeros_like(ent)), defined


def head_sums(values: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Sum over (batch, query) per head, in float64 on the CPU (some devices lack float64): (H,), (H,) counts."""
    v = torch.where(valid, values, torch.zeros_like(values)).to("cpu", torch.float64)
    return v.sum((0, 2)), valid.to("cpu").sum((0, 2))


def ratio(sums: Tensor, counts: Tensor) -> Tensor:
    """sums / counts with NaN where counts == 0."""
    c = counts.to(torch.float64)
    return torch.where(c > 0, sums / c.clamp(min=1), torch.full_like(sums, float("nan")))


def prepare(w, visible, query_mask, name: str = "w"):
    """Validate (w, visible, query_mask) and return (w, vis (B, H, T, S), real (B, H, T))."""
    w = check_weights(w, name)
    B, H, T, S = w.shape
    vis = expand_visible(visible, w.shape, w.device)
    real = real_queries(vis, check_query_mask(query_mask, B, T, w.device))
    return w, vis, real


# ---------------------------------------------------------------------------------------------------------------
# histograms
# ---------------------------------------------------------------------------------------------------------------
def histogram_edges(bins, value_range) -> Tensor:
    """Histogram edges (n+1,) float64 from an int count over value_range, or validated explicit edges."""
    if isinstance(bins, int):
        if bins < 1:
            raise ValueError(f"bins must be >= 1, got {bins}")
        lo, hi = value_range
        if not hi > lo:
            raise ValueError(f"value_range must be (lo, hi) with hi > lo, got {value_range}")
        return torch.linspace(float(lo), float(hi), bins + 1, dtype=torch.float64)
    e = torch.as_tensor(bins, dtype=torch.float64).cpu()
    if e.dim() != 1 or e.numel() < 2 or not bool((e[1:] > e[:-1]).all()):
        raise ValueError("bins must be an int or a 1-D increasing sequence of at least 2 edges")
    return e


def bin_counts(values: Tensor, valid: Tensor, edges: Tensor) -> Tensor:
    """Counts (n,) int64 of values[valid] in bins [e_k, e_k+1); outside values are clipped into the end bins."""
    v = values.to("cpu", torch.float64)
    v = v[valid.to("cpu") & ~torch.isnan(v)]
    idx = torch.bucketize(v, edges[1:-1], right=True)
    return torch.bincount(idx, minlength=edges.numel() - 1)
