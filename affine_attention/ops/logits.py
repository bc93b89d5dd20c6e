"""The query-key logit statistic of the paper's Fig. 2, computed one way for the training probe and the analysis
recorder: sums of q.k^T * scale and of its absolute value over the keys each real query may see, per head."""
from __future__ import annotations

import torch
from torch import Tensor

from .call import Score
from .reference import attention_logits


def visible_logit_sums(q: Tensor, k: Tensor, vis: Tensor, score: Score, *,
                       query_mask: Tensor | None = None) -> Tensor:
    """(3, Hq) float64 on the CPU: per head, the sum of the visible logits, the sum of their absolute values and
    their count. q: (B, Hq, T, D), k: (B, Hkv, S, D); vis: (B|1, 1|Hq, T, S) bool, the keys each query sees (of an
    AttentionCall's mask: `reference.visible_of(call.mask)`, or a block of it); score: the call's Score (the logits
    as the model's softmax sees them: scale and softcap); query_mask: (B, T) bool, True on real queries (None: all
    real).

    One sequence at a time, so memory peaks at Hq x T x S logits; bf16/fp16 inputs are reduced in float32 and
    every sum accumulates in float64. Divide the first two rows by the third for means."""
    B, Hq, T, _ = q.shape
    S = k.shape[2]
    if q.dtype not in (torch.float32, torch.float64):
        q, k = q.float(), k.float()
    sums = torch.zeros(3, Hq, dtype=torch.float64)
    for b in range(B):
        qs = score.q_scale
        row = score if qs is None or qs.shape[0] == 1 else score._replace(q_scale=qs[b:b + 1])
        logits = attention_logits(q[b:b + 1], k[b:b + 1], score=row)  # (1, Hq, T, S)
        keep = (vis[b:b + 1] if vis.shape[0] > 1 else vis).expand_as(logits)
        if query_mask is not None:
            keep = keep & query_mask[b:b + 1, None, :, None].to(keep.device)
        x = torch.where(keep, logits, 0.0)  # masked logits may be anything (-inf included): zero them
        sums += torch.stack([x.sum((0, 2, 3), dtype=torch.float64), x.abs_().sum((0, 2, 3), dtype=torch.float64),
                             keep.sum((0, 2, 3)).double()]).cpu()
    return sums
