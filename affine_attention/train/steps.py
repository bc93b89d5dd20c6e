"""The computations of one training step and one evaluation, as functions of the model and its batch: autocast,
gradient accumulation over micro-batches, clipping and the optimizer step, the eval record."""
from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from .config import DataConfig
from .distributed import DistInfo, accumulation
from .kd_chunked import CHUNK_TOKENS, final_hidden, head_loss, output_head
from .metrics import qk_logit_probe, state_per_head, sum_dtype
from .packing import model_inputs


def autocast_for(device: torch.device, precision: str):
    """A context factory for the forward passes (bf16 autocast or none) and whether it is bf16."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if not bf16:
        return contextlib.nullcontext, False
    return (lambda: torch.autocast(device.type, dtype=torch.bfloat16)), True


def accumulate_gradients(model, rows: torch.Tensor, ids: torch.Tensor, *, n_micro: int, micro_batch: int,
                         info: DistInfo, autocast, doc_sep: int | None, teacher=None, kd_alpha: float = 1.0,
                         temperature: float = 1.0, chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """Accumulate gradients over n_micro micro-batches of rows (L, T + 1) with sequence ids (L,); returns (3,)
    sums of micro-batch means of (loss, ce, kd). With a teacher, loss = kd_alpha * kd + (1 - kd_alpha) * ce.
    The loss is made from the final hidden states in chunks of `chunk` tokens (kd_chunked.head_loss)."""
    # Kept on the device: a float() per micro-batch would wait for it each time (one transfer in log_step).
    sums = torch.zeros(3, dtype=sum_dtype(info.device), device=info.device)
    for i in range(n_micro):
        sl = slice(i * micro_batch, (i + 1) * micro_batch)
        inputs, targets = rows[sl, :-1], rows[sl, 1:]
        with accumulation(model, info, sync=i == n_micro - 1):
            teacher_targets = teacher.targets(inputs, ids[sl]) if teacher is not None else None
            with autocast():
                hidden = final_hidden(model, model_inputs(inputs, doc_sep))  # (b, T, H)
                # after the forward: an FSDP2 root holds its parameters (the head) unsharded until its backward
                loss, ce, kd = head_loss(hidden, output_head(model), targets, teacher=teacher_targets,
                                         temperature=temperature, kd_alpha=kd_alpha, chunk=chunk)
            if teacher is not None:
                teacher.release()
            (loss / n_micro).backward()
        sums += torch.stack([loss.detach(), ce, kd]).to(sums.dtype)
    return sums


def clip_and_step(model, optimizer: torch.optim.Optimizer, clip: float) -> float:
    """Clip the gradients to norm `clip` (0: no clipping), step and clear them; returns the global pre-clip norm."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@torch.no_grad()
def heldout_loss(model, sequences: torch.Tensor, batch: int, autocast, doc_sep: int | None = None,
                 chunk: int = CHUNK_TOKENS) -> float:
    """Mean next-token cross-entropy over sequences (N, T + 1) int64 (on the model's device), made from the final
    hidden states in chunks of `chunk` tokens (kd_chunked.head_loss: never (tokens, vocab) logits for a batch);
    doc_sep: the separator id under document masking (see packing.py), None to attend across documents."""
    total, count = 0.0, 0
    root = model if hasattr(model, "unshard") else None  # an FSDP2 root reshards after a forward without grad
    for i in range(0, sequences.shape[0], batch):
        rows = sequences[i:i + batch]
        with autocast():
            hidden = final_hidden(model, model_inputs(rows[:, :-1], doc_sep))  # (b, T, H)
            if root is not None:
                root.unshard()  # the head, whole, for the loss
            _, ce, _ = head_loss(hidden, output_head(model), rows[:, 1:], chunk=chunk)
        if root is not None:
            root.reshard()
        total += float(ce) * rows[:, 1:].numel()
        count += rows[:, 1:].numel()
    return total / count


def eval_record(model, held: torch.Tensor, dc: DataConfig, autocast, doc_sep: int | None,
                step: int, chunk: int = CHUNK_TOKENS) -> dict[str, Any]:
    """Held-out loss on the first dc.eval_sequences of `held`, the query-key logit probe on its first
    dc.probe_sequences and the variant's per-head state, as an eval record; the model is back in train mode after."""
    model.eval()
    try:
        rec = {"kind": "eval", "step": step}
        loss = heldout_loss(model, held[:dc.eval_sequences], dc.eval_batch, autocast, doc_sep, chunk)
        rec.update(heldout_loss=loss, heldout_ppl=math.exp(loss))
        rec.update(qk_logit_probe(model, held[:dc.probe_sequences, :-1], autocast, doc_sep))
        rec.update(state_per_head(model))
    finally:
        model.train()
    return rec
