"""Per-document attention for packed rows: the model inputs that tell a transformers causal LM where documents end.

Rows are windows of one token stream in which every document ends with the separator (data.py). With
`data.document_mask = true` each row gets `position_ids` that restart after every separator, with no attention mask
and no cache: transformers' own packing signal (what `DataCollatorWithFlattening` produces). Converted models turn
it into `document_ids` for the variants' fast paths (hf/packing.py); unconverted models (e.g. a KD teacher) build
their own block-diagonal mask from it, so student and teacher see the same document boundaries.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def document_positions(inputs: Tensor, sep: int) -> Tensor:
    """inputs: (B, T) token ids -> position_ids (B, T) int64 that restart at 0 after every separator token.

    The separator belongs to the document it ends; the first document of a row (the tail of one that began in an
    earlier row) starts at position 0 too, as every row does without document masking.
    """
    B, T = inputs.shape
    ends = (inputs == sep).long()
    # Document index of each position: separators strictly before it.
    doc = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], dim=1).cumsum(-1)
    idx = torch.arange(T, device=inputs.device).expand(B, T)
    starts = torch.where(torch.cat([torch.ones_like(ends[:, :1], dtype=torch.bool), doc[:, 1:] != doc[:, :-1]], 1),
                         idx, torch.zeros_like(idx))
    return idx - starts.cummax(-1).values


def model_inputs(inputs: Tensor, sep: int | None) -> dict[str, Any]:
    """Keyword arguments of a causal LM forward for a batch of packed rows inputs: (B, T).

    sep: the separator id under document masking, or None for attention across documents (plain input_ids).
    """
    if sep is None:
        return {"input_ids": inputs}
    return {"input_ids": inputs, "position_ids": document_positions(inputs, sep), "use_cache": False}
