"""Gradient-norm statistics over early training (the paper's diagnostic 8): mean, std, variance, CV and MAD spike counts,
read from a training run's metrics JSONL file."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .._files import log_records

__all__ = ["read_grad_norms", "grad_norm_stats", "spike_counts", "stats_from_file"]


def _is_step_line(rec: dict) -> bool:
    """A training-step record: has "step" and is not tagged as another kind of record (eval, config, ...)."""
    return "step" in rec and rec.get("kind", "train") == "train"


def read_grad_norms(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read (steps, grad_norms) from a metrics JSONL file, sorted by step.

    Format: one JSON object per line; blank lines are skipped. A *step line* is an object with a "step" key and
    either no "kind" key or "kind": "train". Every step line must carry a numeric "grad_norm" (a step line
    without one is an error, because dropping it silently would shift the statistics window). Lines that are
    not step lines (run headers, eval records with "kind": "eval", ...) are ignored whether or not they have
    a grad_norm. If a step appears more than once (a resumed run re-logging steps) the last line wins.
    Non-finite norms (NaN, Infinity, which Python's json accepts) are kept as they are.

    Raises ValueError naming the line number for malformed JSON, a line that is not an object, a non-integer
    step, or a step line without a numeric grad_norm.
    """
    by_step: dict[int, float] = {}
    for lineno, rec in log_records(path):
        if not isinstance(rec, dict):
            raise ValueError(f"{path}: line {lineno}: expected a JSON object, got {type(rec).__name__}")
        if not _is_step_line(rec):
            continue
        step, norm = rec["step"], rec.get("grad_norm")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"{path}: line {lineno}: 'step' must be an integer, got {step!r}")
        if isinstance(norm, bool) or not isinstance(norm, (int, float)):
            raise ValueError(f"{path}: line {lineno}: step line without a numeric 'grad_norm' (got {norm!r})")
        by_step[step] = float(norm)
    steps = np.array(sorted(by_step), dtype=np.int64)
    return steps, np.array([by_step[s] for s in steps], dtype=np.float64)


def _window(norms, steps, window: tuple[int, int]) -> np.ndarray:
    """norms (N,) restricted to steps in [start, end); steps default to 0..N-1 (the index is the step)."""
    x = np.asarray(norms, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"norms must be 1-D of shape (N,), got shape {x.shape}")
    s = np.arange(len(x)) if steps is None else np.asarray(steps)
    if s.shape != x.shape:
        raise ValueError(f"steps must have the same shape as norms {x.shape}, got shape {s.shape}")
    start, end = window
    if not end > start:
        raise ValueError(f"window must be (start, end) with end > start, got {window}")
    return x[(s >= start) & (s < end)]


def grad_norm_stats(norms: Sequence[float] | np.ndarray, steps: Sequence[int] | np.ndarray | None = None,
                    window: tuple[int, int] = (0, 500)) -> dict:
    """Mean, std, variance and coefficient of variation of gradient norms over steps in [start, end).

    Layout: norms (N,), steps (N,) or None (then step = index).

    Definition over the finite norms x_1..x_n in the window: mean = sum x / n; variance = sum (x - mean)^2 / n
    (population variance: the window is the whole set of steps under study, not a sample of it); std =
    sqrt(variance); cv = std / mean (NaN when mean == 0). Non-finite norms (overflowed steps) are left out of
    these moments and counted in "n_nonfinite". Returns dict(mean, std, variance, cv, n, n_nonfinite).
    Raises ValueError if the window holds no finite norm.
    """
    x = _window(norms, steps, window)
    fin = x[np.isfinite(x)]
    if fin.size == 0:
        raise ValueError(f"no finite grad_norm in steps [{window[0]}, {window[1]})")
    mean = float(fin.mean())
    var = float(fin.var(ddof=0))
    std = math.sqrt(var)
    return {"mean": mean, "std": std, "variance": var, "cv": std / mean if mean != 0 else float("nan"),
            "n": int(fin.size), "n_nonfinite": int(x.size - fin.size)}


def _median_mad(x: np.ndarray) -> tuple[float, float]:
    fin = x[np.isfinite(x)]
    if fin.size == 0:
        raise ValueError("no finite grad_norm in the window")
    med = float(np.median(fin))
    return med, float(np.median(np.abs(fin - med)))


def spike_counts(norms: Sequence[float] | np.ndarray, ks: Iterable[float] = (6, 9),
                 steps: Sequence[int] | np.ndarray | None = None, window: tuple[int, int] = (0, 500)) -> dict:
    """Number of gradient-norm spikes in the window for each threshold multiplier k.

    Layout: norms (N,), steps (N,) or None (then step = index).

    Definition: over the steps in [start, end), med = median of the finite norms and MAD = median(|x - med|),
    the raw (unscaled, no 1.4826 factor) median absolute deviation. A step is a spike for k when
    norm > med + k * MAD (strict). +Infinity counts as a spike, NaN never does. If MAD == 0 every norm above the
    median is a spike. Returns {k: count}.
    """
    x = _window(norms, steps, window)
    med, mad = _median_mad(x)
    with np.errstate(invalid="ignore"):
        return {k: int(np.sum(x > med + k * mad)) for k in ks}


def stats_from_file(path: str | Path, window: tuple[int, int] = (0, 500), ks: Iterable[float] = (6, 9)) -> dict:
    """`grad_norm_stats` and `spike_counts` of a metrics JSONL file (see `read_grad_norms` for the format).

    Returns dict(mean, std, variance, cv, n, n_nonfinite, median, mad, spikes={k: count}, window).
    """
    steps, norms = read_grad_norms(path)
    out = grad_norm_stats(norms, steps, window)
    med, mad = _median_mad(_window(norms, steps, window))
    out.update(median=med, mad=mad, spikes=spike_counts(norms, ks, steps, window), window=tuple(window))
    return out
