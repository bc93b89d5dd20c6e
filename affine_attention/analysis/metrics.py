"""The paper's attention diagnostics as pure tensor functions (no hooks, no models).

Each function takes materialised weights and masks and reduces over batch and real queries; `LayerStats`
does the same reductions chunk by chunk so a caller never has to hold every layer's weights at once.

Shared conventions (every function states its own layout too):
  w           (B, H, T, S) float   attention weights over keys (softmax p, sink weights, affine a = alpha*p + beta).
                                   Affine rows need not sum to one and may be negative; sink rows sum to 1 - sink mass.
  visible     (B|1, H|1, T, S) bool  True = query i may attend key j. Entries of `w` where it is False are
                                   ignored (treated as 0), whatever they hold (0, NaN, garbage). None = all visible.
  query_mask  (B, T) bool          True = real (non-padding) query. None = all real.
  sink_mass   (B, H, T) float      weight given to the learned sink (1 - sum of key weights), sink variants only.
A *real query* is one with query_mask True and at least one visible key; only real queries enter any mean.
Per-head results are float64 CPU tensors; a head without any real query gives NaN.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

__all__ = [
    "first_token_mass",
    "total_mass",
    "mean_total_mass",
    "head_utilisation",
    "attention_entropy",
    "mean_attention_map",
    "alpha_distribution",
    "mean_qk_logit",
    "mass_histogram",
    "LayerStats",
]

_SINK_EPS = 1e-12  # queries whose key share 1 - sink_mass is below this carry no key mass to normalise


# ---------------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------------
def _shape(x: Tensor) -> tuple:
    return tuple(x.shape)


def _check_rank4(x, name: str) -> Tensor:
    """A floating (B, H, T, S) tensor; half precisions are upcast to float32 so sums stay accurate."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape (B, H, T, S), got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have shape (B, H, T, S), got shape {_shape(x)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor of shape (B, H, T, S), got dtype {x.dtype}")
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _expand_visible(visible, shape: tuple, device) -> Tensor:
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
        raise ValueError(f"visible must have shape ({B}|1, {H}|1, {T}, {S}), got shape {_shape(visible)}")
    return visible.to(device).expand(B, H, T, S)


def _check_query_mask(query_mask, B: int, T: int, device) -> Tensor:
    """query_mask (B, T) bool -> itself; None -> all True."""
    if query_mask is None:
        return torch.ones((B, T), dtype=torch.bool, device=device)
    if not isinstance(query_mask, Tensor) or query_mask.dtype != torch.bool:
        raise ValueError(f"query_mask must be a bool torch.Tensor of shape ({B}, {T})")
    if _shape(query_mask) != (B, T):
        raise ValueError(f"query_mask must have shape ({B}, {T}), got shape {_shape(query_mask)}")
    return query_mask.to(device)


def _check_rows(x, name: str, B: int, H: int, T: int, device) -> Tensor:
    """A per-query float tensor (B, H, T), e.g. sink_mass."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating torch.Tensor of shape ({B}, {H}, {T})")
    if _shape(x) != (B, H, T):
        raise ValueError(f"{name} must have shape ({B}, {H}, {T}), got shape {_shape(x)}")
    return x.to(device)


# ---------------------------------------------------------------------------------------------------------------
# per-query kernels: (B, H, T, S) -> (B, H, T); shared by the one-shot functions and LayerStats
# ---------------------------------------------------------------------------------------------------------------
def _real_queries(vis: Tensor, qmask: Tensor) -> Tensor:
    """(B, H, T) bool: query is real (query_mask) and sees at least one key."""
    return vis.any(-1) & qmask[:, None, :]


def _first_key_weight(w: Tensor, vis: Tensor) -> Tensor:
    """(B, H, T): weight on each query's first visible key (0 for rows that see nothing)."""
    S = w.shape[-1]
    pos = torch.arange(S, device=w.device)
    first = torch.where(vis, pos, S).amin(-1)  # S when nothing is visible
    val = w.gather(-1, first.clamp(max=S - 1).unsqueeze(-1)).squeeze(-1)
    return torch.where(first < S, val, torch.zeros_like(val))


def _row_total(w: Tensor, vis: Tensor, exclude_first: bool) -> Tensor:
    """(B, H, T): sum of weights over visible keys, minus the first visible key's weight if exclude_first."""
    total = torch.where(vis, w, torch.zeros_like(w)).sum(-1)
    return total - _first_key_weight(w, vis) if exclude_first else total


def _sink_normalise(total: Tensor, sink: Tensor) -> tuple[Tensor, Tensor]:
    """total / (1 - sink) and where that is defined (1 - sink > eps)."""
    share = 1.0 - sink.to(total.dtype)
    ok = share > _SINK_EPS
    return total / torch.where(ok, share, torch.ones_like(share)), ok


def _row_entropy(w: Tensor, vis: Tensor, sink: Tensor | None) -> tuple[Tensor, Tensor]:
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


def _head_sums(values: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Sum over (batch, query) per head, in float64 on the CPU (some devices lack float64): (H,), (H,) counts."""
    v = torch.where(valid, values, torch.zeros_like(values)).to("cpu", torch.float64)
    return v.sum((0, 2)), valid.to("cpu").sum((0, 2))


def _ratio(sums: Tensor, counts: Tensor) -> Tensor:
    """sums / counts with NaN where counts == 0."""
    c = counts.to(torch.float64)
    return torch.where(c > 0, sums / c.clamp(min=1), torch.full_like(sums, float("nan")))


def _prepare(w, visible, query_mask, name: str = "w"):
    """Validate (w, visible, query_mask) and return (w, vis (B, H, T, S), real (B, H, T))."""
    w = _check_rank4(w, name)
    B, H, T, S = w.shape
    vis = _expand_visible(visible, w.shape, w.device)
    real = _real_queries(vis, _check_query_mask(query_mask, B, T, w.device))
    return w, vis, real


# ---------------------------------------------------------------------------------------------------------------
# one-shot metrics
# ---------------------------------------------------------------------------------------------------------------
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
    w, vis, real = _prepare(w, visible, query_mask)
    return _ratio(*_head_sums(_first_key_weight(w, vis), real))


def total_mass(w: Tensor, visible: Tensor | None = None, exclude_first: bool = True) -> Tensor:
    """Per-query total attention mass over non-sink tokens (the paper's histogram quantity).

    Layout: w (B, H, T, S); visible (B|1, H|1, T, S) bool or None -> (B, H, T), same dtype/device as w (>= float32).

    Definition: total[b, h, i] = sum_{j visible} w[b, h, i, j]  -  [exclude_first] * w[b, h, i, f(b, h, i)],
    with f the first visible key (see `first_token_mass`): the first token is the emergent attention-sink token,
    so it is left out by default. Signed sum: negative affine entries reduce the total. The learned sink of sink
    variants is not a key, so its mass is never included (a sink row over keys sums to 1 - sink mass). Rows that
    see no key give 0. Every query is returned, padded ones included: filter with query_mask when reducing.
    """
    w = _check_rank4(w, "w")
    return _row_total(w, _expand_visible(visible, w.shape, w.device), exclude_first)


def mean_total_mass(w: Tensor, visible: Tensor | None = None, query_mask: Tensor | None = None,
                    sink_mass: Tensor | None = None, *, exclude_first: bool = True,
                    sink_excluded: bool = True) -> Tensor:
    """Per-head mean total mass: one row of the paper's layer x head utilisation heatmap (PAPER.md item 4).

    Layout: w (B, H, T, S); visible (B|1, H|1, T, S); query_mask (B, T); sink_mass (B, H, T) or None -> (H,) float64.

    Definition: m[b, h, i] = total_mass(w, visible, exclude_first)[b, h, i]. If sink_mass is given and
    sink_excluded is True the sink's share is taken out of the denominator:

        m[b, h, i] <- m[b, h, i] / (1 - sink_mass[b, h, i]),

    i.e. the fraction of the mass that went to keys at all which lands on non-first tokens (queries with
    1 - sink_mass <= 1e-12 put nothing on keys and are excluded). Without sink_mass, or with sink_excluded=False,
    m is the raw total. Result[h] = mean of m over real queries (padding and key-less queries excluded).
    """
    w, vis, real = _prepare(w, visible, query_mask)
    m = _row_total(w, vis, exclude_first)
    if sink_mass is not None:
        B, H, T, _ = w.shape
        sink = _check_rows(sink_mass, "sink_mass", B, H, T, w.device)
        if sink_excluded:
            m, ok = _sink_normalise(m, sink)
            real = real & ok
    return _ratio(*_head_sums(m, real))


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
        got = _shape(masses) if isinstance(masses, Tensor) else type(masses).__name__
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


def attention_entropy(w: Tensor, visible: Tensor | None = None, query_mask: Tensor | None = None,
                      sink_mass: Tensor | None = None) -> Tensor:
    """Mean attention entropy per head, in nats, defined for weights that need not sum to one or be positive.

    Layout: w (B, H, T, S); visible (B|1, H|1, T, S); query_mask (B, T); sink_mass (B, H, T) or None -> (H,) float64.

    Definition: for a real query with visible keys V, let a_j = |w_j| for j in V, a_sink = |sink_mass| (0 when
    not given), Z = sum_j a_j + a_sink, q = a / Z. Then

        entropy = - sum_{j in V} q_j log q_j  -  q_sink log q_sink        (0 log 0 = 0),

    and the result is its mean over real queries; queries with Z = 0 (no mass anywhere) are excluded.
    Why this choice: for softmax rows it is exactly the Shannon entropy of the attention distribution; for sink
    variants it is the entropy of the full distribution over keys plus the sink (which sums to one); for affine
    rows, |a_j| is how much key j's value vector contributes to the output whatever its sign, and renormalising
    makes the number a pure measure of spread, independent of the row's overall scale (alpha_ma). It lies in
    [0, log(|V| + [sink])]: log|V| when all visible keys contribute equally, 0 when one key carries everything.
    """
    w, vis, real = _prepare(w, visible, query_mask)
    sink = None
    if sink_mass is not None:
        B, H, T, _ = w.shape
        sink = _check_rows(sink_mass, "sink_mass", B, H, T, w.device)
    ent, defined = _row_entropy(w, vis, sink)
    return _ratio(*_head_sums(ent, real & defined))


def mean_attention_map(w: Tensor, visible: Tensor | None = None, size: int = 30,
                       query_mask: Tensor | None = None) -> Tensor:
    """Head- and batch-averaged attention map of the first `size` queries x `size` keys (one layer).

    Layout: w (B, H, T, S); visible (B|1, H|1, T, S); query_mask (B, T) -> (min(size, T), min(size, S)) float64.

    Definition: map[i, j] = mean over heads h and over sequences b whose query i is real of
    visible[b, h, i, j] * w[b, h, i, j]. Masked entries count as 0; rows i with no real query anywhere are 0.
    Positions are absolute: for left-padded batches pass unpadded (or right-padded) sequences so that row i
    means the same token position in every sequence.
    """
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    w, vis, _ = _prepare(w, visible, None)
    B, H, T, S = w.shape
    qm = _check_query_mask(query_mask, B, T, w.device)
    t, s = min(size, T), min(size, S)
    sub = torch.where(vis[:, :, :t, :s], w[:, :, :t, :s], torch.zeros_like(w[:, :, :t, :s]))
    rows = qm[:, :t].to(sub.dtype)  # (B, t)
    summed = (sub.sum(1) * rows[:, :, None]).sum(0).to("cpu", torch.float64)  # (t, s)
    n = (rows.sum(0) * H).to("cpu", torch.float64)[:, None]
    return torch.where(n > 0, summed / n.clamp(min=1), torch.zeros_like(summed))


def alpha_distribution(alpha: Tensor, query_mask: Tensor | None = None,
                       quantiles: Sequence[float] = (0.05, 0.25, 0.5, 0.75, 0.95)) -> dict:
    """Summary of the learned per-query scale alpha (PAPER.md item 9).

    Layout: alpha (B, H, T) float; query_mask (B, T) bool or None.

    Returns a dict of float64 CPU tensors over real (non-padded) queries:
      "mean" (H,), "std" (H,) population std (divide by n), "quantiles" (Q, H) at the levels in "levels" (Q,),
      "values" (n_real * H,) all real alpha values flattened (for histograms), "n" number of real queries.
    Heads are NaN when there is no real query.
    """
    if not isinstance(alpha, Tensor) or alpha.dim() != 3 or not alpha.is_floating_point():
        got = _shape(alpha) if isinstance(alpha, Tensor) else type(alpha).__name__
        raise ValueError(f"alpha must be a floating tensor of shape (B, H, T), got {got}")
    B, H, T = alpha.shape
    qm = _check_query_mask(query_mask, B, T, alpha.device).to("cpu")
    levels = torch.tensor(list(quantiles), dtype=torch.float64)
    if levels.numel() and ((levels < 0) | (levels > 1)).any():
        raise ValueError(f"quantiles must lie in [0, 1], got {list(quantiles)}")
    a = alpha.detach().to("cpu", torch.float64).permute(1, 0, 2)[:, qm]  # (H, n_real)
    n = a.shape[1]
    if n == 0:
        nan = torch.full((H,), float("nan"), dtype=torch.float64)
        return {"mean": nan, "std": nan.clone(), "quantiles": nan.expand(len(levels), H).clone(),
                "levels": levels, "values": a.reshape(-1), "n": 0}
    return {
        "mean": a.mean(1),
        "std": a.std(1, correction=0),
        "quantiles": torch.quantile(a, levels, dim=1) if levels.numel() else torch.empty(0, H, dtype=torch.float64),
        "levels": levels,
        "values": a.reshape(-1),
        "n": n,
    }


def mean_qk_logit(logits: Tensor, visible: Tensor | None = None,
                  query_mask: Tensor | None = None) -> tuple[float, float]:
    """Mean and mean absolute value of the query-key logits over visible entries (PAPER.md item 1).

    Layout: logits (B, H, T, S) float (q.k^T * scale, before masking); visible (B|1, H|1, T, S); query_mask (B, T).

    Definition: mean = sum_{visible (b,h,i,j), real query} x_bhij / count, mean_abs the same with |x|.
    Masked entries (which may hold -inf) and padded queries are ignored. No visible entry -> (nan, nan).
    """
    x, vis, real = _prepare(logits, visible, query_mask, "logits")
    keep = vis & real.unsqueeze(-1)
    n = int(keep.sum())
    if n == 0:
        return float("nan"), float("nan")
    acc = x.dtype if x.device.type == "mps" else torch.float64  # MPS has no float64
    sel = torch.where(keep, x, torch.zeros_like(x)).to(acc)
    return float(sel.sum()) / n, float(sel.abs().sum()) / n


def _edges(bins, value_range) -> Tensor:
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


def _bin_counts(values: Tensor, valid: Tensor, edges: Tensor) -> Tensor:
    """Counts (n,) int64 of values[valid] in bins [e_k, e_k+1); outside values are clipped into the end bins."""
    v = values.to("cpu", torch.float64)
    v = v[valid.to("cpu") & ~torch.isnan(v)]
    idx = torch.bucketize(v, edges[1:-1], right=True)
    return torch.bincount(idx, minlength=edges.numel() - 1)


def mass_histogram(total: Tensor, query_mask: Tensor | None = None, bins: int | Sequence[float] | Tensor = 50,
                   value_range: tuple[float, float] = (0.0, 1.0)) -> tuple[Tensor, Tensor]:
    """Histogram of per-query total mass across real queries and heads (PAPER.md item 2).

    Layout: total (B, H, T) float (from `total_mass`); query_mask (B, T) or (B, H, T) bool or None
    -> (counts (n,) int64, edges (n+1,) float64).

    `bins` is a number of equal bins over value_range or explicit increasing edges. Bin k is
    [edges[k], edges[k+1]); values below edges[0] go to the first bin and values >= edges[-1] to the last, so
    every real query is counted exactly once (counts.sum() == number of real (b, h, i)). NaN values are dropped.
    """
    if not isinstance(total, Tensor) or total.dim() != 3:
        got = _shape(total) if isinstance(total, Tensor) else type(total).__name__
        raise ValueError(f"total must have shape (B, H, T), got {got}")
    B, H, T = total.shape
    if isinstance(query_mask, Tensor) and query_mask.dim() == 3:
        if query_mask.dtype != torch.bool or _shape(query_mask) != (B, H, T):
            raise ValueError(f"query_mask must be bool of shape ({B}, {T}) or ({B}, {H}, {T}), "
                             f"got {_shape(query_mask)}")
        valid = query_mask
    else:
        valid = _check_query_mask(query_mask, B, T, total.device)[:, None, :].expand(B, H, T)
    edges = _edges(bins, value_range)
    return _bin_counts(total, valid, edges), edges


# ---------------------------------------------------------------------------------------------------------------
# chunk-wise accumulator
# ---------------------------------------------------------------------------------------------------------------
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
        self.hist_edges = _edges(self.hist_edges, (0.0, 1.0))  # an int means that many bins over [0, 1]

    def update(self, w: Tensor, visible: Tensor | None = None, query_mask: Tensor | None = None,
               sink_mass: Tensor | None = None) -> None:
        """Add one chunk: w (B, H, T, S), visible (B|1, H|1, T, S), query_mask (B, T), sink_mass (B, H, T)."""
        w, vis, real = _prepare(w, visible, query_mask)
        B, H, T, _ = w.shape
        if self._num_heads is not None and H != self._num_heads:
            raise ValueError(f"w must have {self._num_heads} heads like earlier updates, got shape {_shape(w)}")
        self._num_heads = H
        sink = _check_rows(sink_mass, "sink_mass", B, H, T, w.device) if sink_mass is not None else None

        total = _row_total(w, vis, self.exclude_first)
        ent, defined = _row_entropy(w, vis, sink)
        normed, ok = _sink_normalise(total, sink) if sink is not None else (total, real)
        self._add("first", *_head_sums(_first_key_weight(w, vis), real))
        self._add("entropy", *_head_sums(ent, real & defined))
        self._add("total", *_head_sums(total, real))
        self._add("total_se", *_head_sums(normed, real & ok))
        hist = torch.stack([_bin_counts(total[:, h], real[:, h], self.hist_edges) for h in range(H)])
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
            "first_token_mass": _ratio(*self._acc["first"]),
            "entropy": _ratio(*self._acc["entropy"]),
            "mean_total_mass": _ratio(*self._acc["total"]),
            "mean_total_mass_sink_excluded": _ratio(*self._acc["total_se"]),
            "hist_counts": self._acc["hist"].clone(),
            "hist_edges": self.hist_edges.clone(),
            "n_queries": self._acc["total"][1].clone(),
        }
