"""Small summary statistics shared by the run summary (train.compare), the report and its claims (analysis) and the
evaluation summaries (eval): mean and std over seeds, the one rule that reads a direction from paired differences,
and the window of the final train loss."""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

# The rule for paired differences d (one per seed): a direction only when there are at least MIN_SEEDS of them and
# |mean| > SPREAD_FACTOR x their sample std. A rough screen, not a significance test.
SPREAD_FACTOR = 2.0
MIN_SEEDS = 2
FINAL_LOSS_WINDOW = 0.05  # final train loss = mean over the last 5% of the steps (at least one)


def mean_std(values: Iterable) -> tuple[float | None, float | None, int]:
    """(mean, sample std, n) over the finite values, skipping None; std is None below two values, both None for
    none."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    if not v:
        return None, None, 0
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else None), len(v)


def spread_direction(diffs: Iterable) -> int | None:
    """The rule above on paired differences: +1 (above zero) or -1 (below), 0 within the seed spread (a mean of
    exactly zero included), None with fewer than MIN_SEEDS finite values."""
    mean, std, n = mean_std(diffs)
    if n < MIN_SEEDS:
        return None
    return (1 if mean > 0 else -1) if abs(mean) > SPREAD_FACTOR * std else 0


def final_window(steps: int) -> int:
    """How many of the last steps the final train loss averages: FINAL_LOSS_WINDOW of them, at least one."""
    return max(1, round(FINAL_LOSS_WINDOW * steps))
