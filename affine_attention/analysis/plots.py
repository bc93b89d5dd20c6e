"""The paper's figures from plain data (dicts variant -> arrays): each function writes one PNG and returns its path.

Figures are built with matplotlib's object API (`matplotlib.figure.Figure`, saved through Agg), never pyplot, so
importing or calling this module changes no global backend and leaves no open figures behind."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from .mass_metrics import head_utilisation
from .style import style_for

__all__ = [
    "plot_loss_curves",
    "plot_grad_norms",
    "plot_qk_logit",
    "plot_per_layer",
    "plot_head_heatmaps",
    "plot_mass_histograms",
    "plot_attention_map",
    "plot_alpha_histograms",
]

DPI = 150
_PANEL = (4.4, 3.6)  # inches per panel
_MAX_WIDTH = 10.5  # inches: a wider grid is shrunk, text included, into the report's ~1,130 px column at 1280 px


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def _np(x, name: str, ndim: int | None = None) -> np.ndarray:
    """Array-like (list, numpy, torch tensor on any device) -> float64 numpy array of the given rank."""
    if hasattr(x, "detach"):
        x = x.detach().to("cpu").double().numpy()
    a = np.asarray(x, dtype=np.float64)
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    return a


def _check_mapping(d, name: str) -> None:
    if not isinstance(d, Mapping) or not d:
        raise ValueError(f"{name} must be a non-empty dict variant -> data")


def _curves(curves, name: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """dict variant -> (steps (N,), values (N,)) validated into numpy pairs."""
    _check_mapping(curves, name)
    out = {}
    for k, pair in curves.items():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"{name}[{k!r}] must be a pair (steps (N,), values (N,))")
        s, v = _np(pair[0], f"{name}[{k!r}] steps", 1), _np(pair[1], f"{name}[{k!r}] values", 1)
        if s.shape != v.shape:
            raise ValueError(f"{name}[{k!r}]: steps {s.shape} and values {v.shape} must have the same shape (N,)")
        out[k] = (s, v)
    return out


def _smooth(y: np.ndarray, k: int) -> np.ndarray:
    """Trailing moving average over k points (same length; the first points average what exists)."""
    if k <= 1 or y.size == 0:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    idx = np.arange(1, y.size + 1)
    lo = np.maximum(idx - k, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def _figure(nrows: int, ncols: int, title: str, size=_PANEL):
    from matplotlib.figure import Figure  # lazy: the rest of the package works without matplotlib

    shrink = min(1.0, _MAX_WIDTH / (size[0] * ncols))
    fig = Figure(figsize=(size[0] * ncols * shrink, size[1] * nrows * shrink), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    fig.suptitle(title)
    return fig, axes


def _grid(n: int, max_cols: int = 3) -> tuple[int, int]:
    ncols = min(n, max_cols)
    return -(-n // ncols), ncols


def _panels(n: int, title: str):
    """A grid of n panels (extra cells removed): (fig, list of n axes)."""
    nrows, ncols = _grid(n)
    fig, axes = _figure(nrows, ncols, title)
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.remove()
    return fig, flat[:n]


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight", format="png")
    return path


MARKERS_PER_LINE = 12  # long curves carry a few markers, so lines differ by shape as well as by colour


def _histogram_data(values, name: str, bins: int, pad: float):
    """(name -> finite 1-D values, all of them pooled, (lo, hi), shared bin edges (bins + 1,)); a constant range is
    widened by `pad` on each side."""
    _check_mapping(values, name)
    data = {}
    for k, v in values.items():
        a = _np(v, f"{name}[{k!r}]").ravel()
        data[k] = a[np.isfinite(a)]
    allv = np.concatenate(list(data.values()))
    lo, hi = (float(allv.min()), float(allv.max())) if allv.size else (0.0, 1.0)
    if hi <= lo:
        lo, hi = lo - pad, hi + pad
    return data, allv, (lo, hi), np.linspace(lo, hi, bins + 1)


def _plot_lines(ax, curves: dict, smooth: int = 1) -> None:
    for i, (name, (s, v)) in enumerate(curves.items()):
        st = style_for(name)
        # Offset each variant's markers a little so markers of overlapping lines do not sit on top of each other.
        every = max(1, s.size // MARKERS_PER_LINE)
        ax.plot(s, _smooth(v, smooth), color=st.color, linestyle=st.linestyle, label=st.label, linewidth=1.4,
                marker=st.marker, markersize=4, markevery=(i * every // len(curves), every))


def _zoom(ax, curves: dict, start: float, end: float, smooth: int, log: bool = False) -> None:
    """Limit ax to steps [start, end] and fit the y-limits to the (smoothed) data inside that range."""
    ax.set_xlim(start, end if end > start else start + 1)
    inside = [_smooth(v, smooth)[(s >= start) & (s <= end)] for s, v in curves.values()]
    vals = np.concatenate(inside) if inside else np.array([])
    vals = vals[np.isfinite(vals) & ((vals > 0) if log else True)]
    if not vals.size:
        return
    lo, hi = float(vals.min()), float(vals.max())
    if log:
        ax.set_ylim(lo / 1.2, hi * 1.2)
    else:
        pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 0.05
        ax.set_ylim(lo - pad, hi + pad)


def _legend(fig, ax) -> None:
    """One legend under the panels, outside every axes, so it never hides a curve."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(handles), 4), fontsize="small",
                   frameon=False)


def _plain_log_ticks(ax) -> None:
    """Log-axis ticks at 1, 2, 5 x 10^k labelled as plain numbers (0.5, 1, 2), not 5x10^-1; minor ticks unlabelled."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _no_data(ax) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.4")


# ---------------------------------------------------------------------------------------------------------------
# training curves
# ---------------------------------------------------------------------------------------------------------------
def _minus(data: dict, reference: str) -> dict:
    """variant -> (steps, variant − reference) on the steps both logged; the reference left out."""
    rs, rv = data[reference]
    pairs = {k: (s, v, np.intersect1d(s, rs, return_indices=True)) for k, (s, v) in data.items() if k != reference}
    return {k: (common, v[i] - rv[j]) for k, (s, v, (common, i, j)) in pairs.items()}


def plot_loss_curves(curves: Mapping[str, tuple], path, zoom_last_frac: float = 0.3, *,
                     title: str = "Training loss", ylabel: str = "loss", smooth: int = 1,
                     reference: str | None = None) -> Path:
    """Loss curves, full run (left) and the last `zoom_last_frac` of the step range (right).

    curves: variant -> (steps (N,), values (N,)). smooth: trailing moving-average window in points (1 = raw).
    The zoom panel's y-limits fit the data inside the zoom window. reference: a variant in curves; the zoom panel
    then shows each other variant minus it (curves of nearly equal losses overlap at any zoom; their differences
    do not), with a line at zero.
    """
    data = _curves(curves, "curves")
    if not 0 < zoom_last_frac <= 1:
        raise ValueError(f"zoom_last_frac must be in (0, 1], got {zoom_last_frac}")
    if reference is not None and reference not in data:
        raise ValueError(f"reference {reference!r} is not one of the curves ({', '.join(data)})")
    fig, axes = _figure(1, 2, title)
    full, zoom = axes[0]
    right = _minus(data, reference) if reference is not None else data
    _plot_lines(full, data, smooth)
    _plot_lines(zoom, right, smooth)
    for ax in (full, zoom):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    full.set_ylabel(ylabel)
    full.set_title("full run")
    if reference is not None:
        zoom.axhline(0.0, color=style_for(reference).color, linewidth=1.2, zorder=0)
        zoom.set_ylabel(f"{ylabel} − {style_for(reference).label}")
        zoom.set_title(f"difference to {style_for(reference).label}, last {zoom_last_frac:.0%} of steps")
    else:
        zoom.set_ylabel(ylabel)
        zoom.set_title(f"last {zoom_last_frac:.0%} of steps")
    steps = np.concatenate([s for s, _ in data.values()])
    if steps.size:
        lo, hi = float(steps.min()), float(steps.max())
        _zoom(zoom, right, hi - zoom_last_frac * (hi - lo), hi, smooth)
    _legend(fig, full)
    return _save(fig, path)


def plot_grad_norms(curves: Mapping[str, tuple], path, *, window: tuple[int, int] | None = (0, 500),
                    log_y: bool = True, title: str = "Gradient norm", smooth: int = 1) -> Path:
    """Gradient-norm curves: the full run, plus a second panel zoomed on the statistics window when given.

    curves: variant -> (steps (N,), grad norms (N,)). The window [start, end) is shaded on the full panel; it is
    the window of `gradstats.grad_norm_stats`. Log y-scale by default (spikes span orders of magnitude); it falls
    back to linear when some norm is not positive.
    """
    data = _curves(curves, "curves")
    fig, axes = _figure(1, 2 if window is not None else 1, title)
    all_v = np.concatenate([v for _, v in data.values()])
    use_log = log_y and all_v.size > 0 and bool(np.all(all_v[np.isfinite(all_v)] > 0))
    for ax in axes[0]:
        _plot_lines(ax, data, smooth)
        ax.set_xlabel("step")
        ax.set_ylabel("gradient norm" + (" (log scale)" if use_log else ""))
        ax.set_yscale("log" if use_log else "linear")
        ax.grid(alpha=0.3, which="both" if use_log else "major")
        if use_log:
            _plain_log_ticks(ax)
    axes[0][0].set_title("full run")
    if window is not None:
        start, end = window
        axes[0][0].axvspan(start, end, color="0.85", zorder=0, label=f"stats window [{start}, {end})")
        _zoom(axes[0][1], data, start, end, smooth, log=use_log)
        axes[0][1].set_title(f"steps {start}-{end}")
    _legend(fig, axes[0][0])
    return _save(fig, path)


def plot_qk_logit(curves: Mapping[str, tuple], path, *, title: str = "Mean query-key logit during training",
                  ylabel: str = "mean QK logit", smooth: int = 1) -> Path:
    """Mean QK^T logit over layers, heads and positions against training step. curves: variant -> (steps, values)."""
    data = _curves(curves, "curves")
    fig, axes = _figure(1, 1, title, size=(6.4, 4.2))
    ax = axes[0][0]
    _plot_lines(ax, data, smooth)
    ax.axhline(0.0, color="0.5", linewidth=0.8, zorder=0)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    _legend(fig, ax)
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# attention diagnostics
# ---------------------------------------------------------------------------------------------------------------
def plot_per_layer(values: Mapping[str, Sequence[float]], ylabel: str, title: str, path) -> Path:
    """One line per variant of a per-layer quantity (first-token mass, entropy, ...). values: variant -> (L,)."""
    _check_mapping(values, "values")
    data = {k: _np(v, f"values[{k!r}]", 1) for k, v in values.items()}
    fig, axes = _figure(1, 1, title, size=(6.4, 4.2))
    ax = axes[0][0]
    for name, v in data.items():
        st = style_for(name)
        ax.plot(np.arange(v.size), v, color=st.color, linestyle=st.linestyle, marker=st.marker, markersize=3.5,
                label=st.label)
    ax.set_xlabel("layer index")
    ax.set_ylabel(ylabel)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    _legend(fig, ax)
    return _save(fig, path)


def plot_head_heatmaps(masses: Mapping[str, object], path, *, normalise: bool = False,
                       title: str = "Head utilisation: normalised total attention mass") -> Path:
    """One layer x head heatmap per variant on a shared [0, 1] colour scale with one colourbar.

    masses: variant -> (L, H), expected already in [0, 1] (e.g. `mass_metrics.head_utilisation`); values outside are
    shown at the end colours. normalise=True applies `head_utilisation` (min-max over each variant's grid) first.
    """
    _check_mapping(masses, "masses")
    grids = {k: _np(v, f"masses[{k!r}]", 2) for k, v in masses.items()}
    if normalise:
        grids = {k: head_utilisation(_as_tensor(g)).numpy() for k, g in grids.items()}
    fig, axes = _panels(len(grids), title)
    im = None
    for ax, (name, g) in zip(axes, grids.items()):
        im = ax.imshow(g, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", interpolation="nearest")
        ax.set_title(style_for(name).label)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        for axis in (ax.xaxis, ax.yaxis):
            axis.get_major_locator().set_params(integer=True)
    fig.colorbar(im, ax=axes, label="normalised total mass", shrink=0.9)
    return _save(fig, path)


def _as_tensor(a: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(a))


def plot_mass_histograms(totals: Mapping[str, object], path, *, bins: int = 50,
                         title: str = "Per-query total attention mass (non-sink tokens)",
                         xlabel: str = "total attention mass") -> Path:
    """One histogram panel per variant over a shared x-range, with labelled mean and median lines.

    totals: variant -> 1-D per-query masses (e.g. `mass_metrics.total_mass` of real queries, flattened). NaN/inf are
    dropped. y is the fraction of queries per bin so variants with different query counts compare directly.
    """
    from matplotlib import patheffects

    data, allv, (lo, hi), edges = _histogram_data(totals, "totals", bins, pad=0.5)
    fig, axes = _panels(len(data), title)
    for ax, (name, a) in zip(axes, data.items()):
        st = style_for(name)
        ax.set_title(st.label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of queries")
        ax.set_xlim(lo, hi)
        if a.size == 0:
            _no_data(ax)
            continue
        ax.hist(a, bins=edges, weights=np.full(a.size, 1.0 / a.size), color=st.color, alpha=0.5)
        # white halo: the lines stay visible over any bar colour, black (softmax) included
        halo = [patheffects.withStroke(linewidth=3.5, foreground="white")]
        ax.axvline(a.mean(), color="black", linestyle="-", linewidth=1.5, path_effects=halo,
                   label=f"mean = {a.mean():.3g}")
        ax.axvline(np.median(a), color="black", linestyle=(0, (3, 2)), linewidth=1.5, path_effects=halo,
                   label=f"median = {np.median(a):.3g}")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_attention_map(maps: Mapping[str, object], path, *,
                       title: str = "Attention weights, first 30 tokens (head-averaged)") -> Path:
    """One query x key heatmap per variant (e.g. `pattern_metrics.mean_attention_map`), shared colour scale and
    colourbar.

    maps: variant -> (T, S), usually (30, 30). Non-negative data use a sequential map from 0 to the largest
    weight; if any weight is negative (affine) a diverging map symmetric about 0 is used so the sign is visible.
    """
    _check_mapping(maps, "maps")
    data = {k: _np(v, f"maps[{k!r}]", 2) for k, v in maps.items()}
    finite = np.concatenate([m[np.isfinite(m)] for m in data.values()])
    signed = finite.size > 0 and finite.min() < 0
    top = float(np.abs(finite).max()) if finite.size else 1.0
    top = top if top > 0 else 1.0
    vmin, vmax, cmap = (-top, top, "RdBu_r") if signed else (0.0, top, "viridis")
    fig, axes = _panels(len(data), title)
    im = None
    for ax, (name, m) in zip(axes, data.items()):
        im = ax.imshow(m, vmin=vmin, vmax=vmax, cmap=cmap, interpolation="nearest")
        ax.set_title(style_for(name).label)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    fig.colorbar(im, ax=axes, label="attention weight", shrink=0.9)
    return _save(fig, path)


def plot_alpha_histograms(alphas: Mapping[str, object], path, *, bins: int = 50,
                          title: str = "Distribution of the learned scale α", xlabel: str = "α") -> Path:
    """Overlaid density histograms of alpha values, one per variant or phi choice (e.g. "sigmoid", "linear_clip").

    alphas: name -> 1-D values (e.g. `scale_metrics.alpha_distribution(...)["values"]`). The legend gives each mean.
    """
    data, allv, (lo, hi), edges = _histogram_data(alphas, "alphas", bins, pad=0.05)
    fig, axes = _figure(1, 1, title, size=(6.4, 4.2))
    ax = axes[0][0]
    for name, a in data.items():
        st = style_for(name)
        if a.size == 0:
            continue
        ax.hist(a, bins=edges, density=True, histtype="stepfilled", alpha=0.25, color=st.color)
        ax.hist(a, bins=edges, density=True, histtype="step", linewidth=1.5, color=st.color,
                linestyle=st.linestyle, label=f"{st.label} (mean {a.mean():.3g})")
    if not allv.size:
        _no_data(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("density")
    ax.grid(alpha=0.3)
    if allv.size:
        ax.legend(fontsize="small")
    return _save(fig, path)
