"""Small summary statistics shared by the run summary (train.compare) and the report (analysis.report)."""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable


def mean_std(values: Iterable) -> tuple[float | None, float | None, int]:
    """(mean, sample std, n) over the finite values, skipping None; std is None below two values, both None for
    none."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    if not v:
        return None, None, 0
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else None), len(v)
