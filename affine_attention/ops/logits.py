"""The query-key logit statistic of the paper's Fig. 2, computed one way for the training probe and the analysis
recorder: sums of q.k^T * scale and of its absolute value over the keys each real query may see, per head."""
from __future__ import annotations

import torch
from torch import Tensor

from .reference import attention_logits, visible_mask


def visible_logit_sums(q: Tensor, k: Tensor, *, attn_mask: Tensor | None = None, is_causal: bool = False,
                       window: int | None = None, document_ids: Tensor | None = None, scale: float | None = None,
                       query_mask: Tensor | None = None, softcap: float | None = None) -> Tensor:
    """(3, Hq) float64 on the CPU: per head, the sum of the visible logits, the sum of their absolute values and
    their count. q: (B, Hq, T, D), k: (B, Hkv, S, D); attn_mask, is_causal, window, document_ids: as on the ops;
    query_mask: (B, T) bool, True on real queries (None: all real); softcap: the logits as the softmax sees them
    (capped, see `attention_logits`).

    One sequence at a time, so memory peaks at Hq x T x S logits; bf16/fp16 inputs are reduced in float32 and
    every sum accumulates in float64. Divide the first two rows by the third for means."""
    B, Hq, T, _ = q.shape
    S = k.shape[2]
    if q.dtype not in (torch.float32, torch.float64):
        q, k = q.float(), k.float()
    vis = visible_mask(attn_mask, is_causal, T, S, q.device, window=window, document_ids=document_ids)
    # vis: (1|B, 1|Hq, T, S)
    sums = torch.zeros(3, Hq, dtype=torch.float64)
    for b in range(B):
        logits = attention_logits(q[b:b + 1], k[b:b + 1], scale=scale, enable_gqa=Hq != k.shape[1],
                                  softcap=softcap)  # (1, Hq, T, S)
        keep = (vis[b:b + 1] if vis.shape[0] > 1 else vis).expand_as(logits)
        if query_mask is not None:
            keep = keep & query_mask[b:b + 1, None, :, None].to(keep.device)
        x = torch.where(keep, logits, 0.0)  # masked logits may be anything (-inf included): zero them
        sums += torch.stack([x.sum((0, 2, 3), dtype=torch.float64), x.abs_().sum((0, 2, 3), dtype=torch.float64),
                             keep.sum((0, 2, 3)).double()]).cpu()
    return sums
