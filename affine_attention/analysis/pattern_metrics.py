"""How attention spreads over keys: the mean entropy per head and the head-averaged attention map.
Layouts as in attention_rows."""
from __future__ import annotations

import torch
from torch import Tensor

from .attention_rows import check_query_mask, check_rows, head_sums, prepare, ratio, row_entropy

__all__ = ["attention_entropy", "mean_attention_map"]


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
    w, vis, real = prepare(w, visible, query_mask)
    sink = None
    if sink_mass is not None:
        B, H, T, _ = w.shape
        sink = check_rows(sink_mass, "sink_mass", B, H, T, w.device)
    ent, defined = row_entropy(w, vis, sink)
    return ratio(*head_sums(ent, real & defined))


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
    w, vis, _ = prepare(w, visible, None)
    B, H, T, S = w.shape
    qm = check_query_mask(query_mask, B, T, w.device)
    t, s = min(size, T), min(size, S)
    sub = torch.where(vis[:, :, :t, :s], w[:, :, :t, :s], torch.zeros_like(w[:, :, :t, :s]))
    rows = qm[:, :t].to(sub.dtype)  # (B, t)
    summed = (sub.sum(1) * rows[:, :, None]).sum(0).to("cpu", torch.float64)  # (t, s)
    n = (rows.sum(0) * H).to("cpu", torch.float64)[:, None]
    return torch.where(n > 0, summed / n.clamp(min=1), torch.zeros_like(summed))
