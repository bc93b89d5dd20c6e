"""NaN isolation: a non-finite key or value that the mask hides reaches no output, on every backend; one that a
query may see still makes that query's output non-finite (never silently replaced)."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .masks import MaskSpec, visible_sum_and_count


def isolate_nonfinite(k: Tensor, v: Tensor, mask: MaskSpec, Hq: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """k, v: (B, Hkv, S, D) -> (k, v with every non-finite key row and value row set to 0, seen), where
    seen: (B, Hkv|Hq, T|1, 1) bool is True for the queries that may see such a row (None when there is none).

    Kernels multiply hidden values by a zero weight and add a -inf bias to hidden logits; 0 * nan and nan - inf are
    nan, so without this a padded or future key poisons rows that never see it. Nothing to do where the mask
    hides no key (every query sees every key, e.g. one decoding step without padding): a non-finite row then
    reaches every output, as in the reference. Eager CPU first asks one reduction per tensor (a nan or inf makes
    the sum non-finite; a finite overflow only sends it on to the exact per-row test), which costs a read of K
    and V and one host sync. Elsewhere (accelerators, torch.compile) asking would sync, so the rows are always
    cleaned: O(S * D) and copies of K and V (a prefix sum of the per-key indicator under structured masks)."""
    if not mask.kinds:
        return k, v, None
    if k.device.type == "cpu" and not torch.compiler.is_compiling() and math.isfinite((k.sum() + v.sum()).item()):
        return k, v, None  # the common case
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # (B, Hkv, S)
    if k.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(bad.any()):
        return k, v, None  # every element finite after all: the sum overflowed
    row = bad[..., None]
    seen, _ = visible_sum_and_count(bad[..., None].to(v.dtype), mask, Hq)
    return k.masked_fill(row, 0), v.masked_fill(row, 0), seen > 0.5


def poison_seen(out: Tensor, seen: Tensor | None) -> Tensor:
    """out: (B, Hq, T, D); seen from `isolate_nonfinite`: the queries that saw a non-finite key or value get nan,
    as they would without isolation (None: nothing was non-finite)."""
    if seen is None:
        return out
    B, Hq, T, D = out.shape
    G = Hq // seen.shape[1]
    hit = seen[:, :, None].expand(B, Hq // G, G, seen.shape[2], 1).reshape(B, Hq, seen.shape[2], 1)
    return out.masked_fill(hit, float("nan"))
