"""The scales that shape attention: the learned per-query alpha and the query-key logits before the softmax.
Layouts as in attention_rows."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .attention_rows import check_query_mask, prepare, shape_of

__all__ = ["alpha_distribution", "mean_qk_logit"]


def alpha_distribution(alpha: Tensor, query_mask: Tensor | None = None,
                       quantiles: Sequence[float] = (0.05, 0.25, 0.5, 0.75, 0.95)) -> dict:
    """Summary of the learned per-query scale alpha (the paper's diagnostic 9).

    Layout: alpha (B, H, T) float; query_mask (B, T) bool or None.

    Returns a dict of float64 CPU tensors over real (non-padded) queries:
      "mean" (H,), "std" (H,) population std (divide by n), "quantiles" (Q, H) at the levels in "levels" (Q,),
      "values" (n_real * H,) all real alpha values flattened (for histograms), "n" number of real queries.
    Heads are NaN when there is no real query.
    """
    if not isinstance(alpha, Tensor) or alpha.dim() != 3 or not alpha.is_floating_point():
        got = shape_of(alpha) if isinstance(alpha, Tensor) else type(alpha).__name__
        raise ValueError(f"alpha must be a floating tensor of shape (B, H, T), got {got}")
    B, H, T = alpha.shape
    qm = check_query_mask(query_mask, B, T, alpha.device).to("cpu")
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
    """Mean and mean absolute value of the query-key logits over visible entries (the paper's diagnostic 1).

    Layout: logits (B, H, T, S) float (q.k^T * scale, before masking); visible (B|1, H|1, T, S); query_mask (B, T).

    Definition: mean = sum_{visible (b,h,i,j), real query} x_bhij / count, mean_abs the same with |x|.
    Masked entries (which may hold -inf) and padded queries are ignored. No visible entry -> (nan, nan).
    """
    x, vis, real = prepare(logits, visible, query_mask, "logits")
    keep = vis & real.unsqueeze(-1)
    n = int(keep.sum())
    if n == 0:
        return float("nan"), float("nan")
    acc = x.dtype if x.device.type == "mps" else torch.float64  # MPS has no float64
    sel = torch.where(keep, x, torch.zeros_like(x)).to(acc)
    return float(sel.sum()) / n, float(sel.abs().sum()) / n
