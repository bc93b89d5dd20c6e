"""Training metrics: the JSONL log, the progress display, variant statistics and the query-key logit probe.

metrics.jsonl holds one JSON object per line, tagged by "kind":
  config  first line: the resolved config and run facts (parameters, tokens per step, world size)
  train   every step: step (optimizer updates done, from 1), loss, ce_loss, kd_loss (KD runs), lr, grad_norm (global
          L2 norm before clipping), tokens_per_s (this step, all ranks), wall_time (s since the run began, across
          resumes), tokens; data_wait_s (time this step waited for its batch), host_syncs (device-to-host waits
          in forward, backward and optimizer step, counted on CUDA; null elsewhere), student_flops_per_s and
          teacher_flops_per_s per device (the teacher's forwards this step ran: in compare's lockstep only the run
          whose step ran the shared forward counts it), and mfu / mfu_student / mfu_teacher against the device's bf16
          dense peak (null where the peak is unknown, e.g. on CPU, where MFU means nothing);
          and the statistics the variant declares: <key>_mean, <key>_std per layer for each per-token statistic
          (variant.token_stats, e.g. affine: alpha_mean, alpha_std over heads and tokens of this step's batches, all
          ranks) and <key> per layer, mean over heads, for each per-head state (variant.state_stats, e.g. alpha_ma,
          sinks)
  eval    at step 0, every train.eval_every steps and at the end: heldout_loss, heldout_ppl, qk_logit_mean,
          qk_logit_abs_mean (and their per-layer lists), each per-head state per layer and head
  resume  where a resumed run continued; end: the final record (alpha_ma equality across ranks, totals)
Query-key logits (paper Fig. 2): forward pre-hooks on every attention-variant module read its AttentionCall (q and k
after projections, q/k norms and RoPE, the mask and the model's score: exactly what the attention op sees), and the
logits q.k^T * scale (softcapped where the model caps: the softmax input) are averaged over the keys each real query
may see, over heads, query positions, probe sequences and layers, in float32, in eval mode on the fixed probe batch.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._files import atomic_write_text, log_records
from ..ops.logits import visible_logit_sums
from ..ops.reference import visible_of
from ..variants import AttentionVariant
from ..variants.base import ForwardArgs
from ..variants.running_stats import recomputing


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a parameter that may be an FSDP2 DTensor (collective in that case)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def variant_modules(model: nn.Module) -> list[AttentionVariant]:
    return [m for m in model.modules() if isinstance(m, AttentionVariant)]


def read_log(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (none if it is absent), read by the one log reader (`_files.log_records`:
    a last line cut by a kill is skipped, a damaged line elsewhere raises ValueError naming the file and line)."""
    path = Path(path)
    return [rec for _, rec in log_records(path)] if path.is_file() else []


class MetricsLog:
    """Append-only JSONL writer (rank 0); `truncate_after` drops records past a resumed step."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled

    def truncate_after(self, step: int) -> None:
        """Drop the records past `step` (and an end record), rewriting the log atomically."""
        if not self.enabled or not self.path.exists():
            return
        keep = [r for r in read_log(self.path) if r.get("kind") != "end" and r.get("step", -1) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r, allow_nan=True) + "\n" for r in keep))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, allow_nan=True) + "\n")


def sum_dtype(device: torch.device) -> torch.dtype:
    """float64 for sums kept on `device` (MPS has no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


class TokenStats:
    """Per-layer sums of each declared per-token statistic (variant.token_stats, e.g. affine's alpha), of its square
    and counts, over the training forwards of one step (forward hooks).

    Each layer's sums live in a buffer of its variant module (`ACC`, not saved), updated in place by the hook: a
    compiled, activation-checkpointed block then traces the update as a buffer mutation, applied once per forward,
    with no Python state changed inside the checkpointed region (which would break the graph there)."""

    ACC = "_token_stats_acc"  # (keys, 3) float64 (float32 on MPS): [sum, sum of squares, count] per key

    def __init__(self, model: nn.Module):
        self.mods = [m for m in variant_modules(model) if m.token_stats]
        self.keys = list(dict.fromkeys(k for m in self.mods for k in m.token_stats))
        for m in self.mods:
            dev = next(iter([*m.parameters(), *m.buffers()])).device
            m.register_buffer(self.ACC, torch.zeros(len(self.keys), 3, dtype=sum_dtype(dev), device=dev),
                              persistent=False)
        self.handles = [m.register_forward_hook(self._hook(), with_kwargs=True) for m in self.mods]

    def _hook(self):
        keys = self.keys

        def hook(module, args, kwargs, output):
            # Skip eval forwards and activation-checkpointing recomputations (inside backward).
            if not module.training or recomputing():
                return
            x = ForwardArgs.of(args, kwargs).x
            acc = getattr(module, TokenStats.ACC)
            with torch.no_grad():
                for key, a in module.token_statistics(x.detach()).items():  # (B, Hq, T)
                    a = a.to(acc.dtype)
                    acc[keys.index(key)] += torch.stack([a.sum(), (a * a).sum(), a.new_tensor(a.numel())])
        return hook

    def collect(self, info) -> dict[str, list[float]]:
        """<key>_mean / <key>_std per layer over all ranks, then reset. Collective under torchrun."""
        if not self.mods:
            return {}
        from .distributed import all_reduce_sum

        bufs = [getattr(m, self.ACC) for m in self.mods]
        # (layer, key, [sum, sum of squares, count]); a layer without a key keeps count 0 and is left out
        acc = all_reduce_sum(torch.stack(bufs).to(info.device), info).cpu().double()  # nccl: device tensors only
        for b in bufs:
            b.zero_()
        out = {}
        for j, key in enumerate(self.keys):
            rows = acc[:, j][acc[:, j, 2] > 0]
            n = rows[:, 2]
            mean = rows[:, 0] / n
            std = (rows[:, 1] / n - mean * mean).clamp(min=0).sqrt()
            out[f"{key}_mean"], out[f"{key}_std"] = mean.tolist(), std.tolist()
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def state_per_head(model: nn.Module) -> dict[str, list[list[float]]]:
    """key -> per layer, per head values of each declared per-head state (variant.state_stats: affine's alpha_ma,
    the sink logits); layers without the key are left out. Collective under FSDP2 (sharded parameters)."""
    out: dict[str, list[list[float]]] = {}
    for m in variant_modules(model):
        for key, t in m.state_statistics().items():
            out.setdefault(key, []).append(_local(t.detach()).float().tolist())
    return out


def state_per_layer(model: nn.Module) -> dict[str, list[float]]:
    """key -> per layer mean over heads of `state_per_head` (the per-step record)."""
    return {k: [sum(x) / len(x) for x in v] for k, v in state_per_head(model).items()}


def running_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The declared per-head states that are buffers, not parameters (running statistics such as alpha_ma): they
    must be equal on every data-parallel rank."""
    params = {id(p) for p in model.parameters()}
    return [t for m in variant_modules(model) for t in m.state_statistics().values() if id(t) not in params]


@torch.no_grad()
def qk_logit_probe(model: nn.Module, tokens: torch.Tensor, autocast, doc_sep: int | None = None) -> dict[str, Any]:
    """Mean and mean |.| of visible query-key logits (module docstring). tokens: (N, T) int64 on the model's device;
    doc_sep: the separator id under document masking (as for `heldout_loss`), None to attend across documents."""
    from .packing import model_inputs

    sums = qk_logit_sums(model, model_inputs(tokens, doc_sep), autocast)
    n = sums[:, 2].clamp(min=1)
    total = sums.sum(0)
    return {"qk_logit_mean": float(total[0] / total[2]), "qk_logit_abs_mean": float(total[1] / total[2]),
            "qk_logit_mean_per_layer": (sums[:, 0] / n).tolist(),
            "qk_logit_abs_mean_per_layer": (sums[:, 1] / n).tolist()}


@torch.no_grad()
def qk_logit_sums(model: nn.Module, inputs: dict[str, Any], autocast) -> torch.Tensor:
    """(L, 3) float64: per attention layer, the sum of the visible logits, of their absolute values and their count,
    over one forward `model(**inputs)`. Each layer's AttentionCall says which keys each query saw (causal, window,
    documents, padding) and how logits were made (scale, softcap); padded queries are left out: the pairs counted
    are the ones the layer's softmax used, as the analysis recorder counts them."""
    mods = variant_modules(model)
    if not mods:
        raise ValueError("the query-key logit probe needs a converted model (no attention-variant modules found)")
    sums = torch.zeros(len(mods), 3, dtype=torch.float64)

    def pre_hook(i):
        def hook(module, args, kwargs):
            fa = ForwardArgs.of(args, kwargs)
            call = fa.call
            sums[i] += visible_logit_sums(call.q, call.k, visible_of(call.mask, call.q.device), call.score,
                                          query_mask=fa.real_queries()).sum(1)
        return hook

    handles = [m.register_forward_pre_hook(pre_hook(i), with_kwargs=True) for i, m in enumerate(mods)]
    try:
        with autocast():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return sums


class Progress:
    """tqdm bar (loss, tok/s, ETA) on a terminal; plain lines every `every` steps otherwise. Rank 0 only."""

    def __init__(self, total: int, start: int, every: int, enabled: bool, label: str = "train"):
        self.total, self.every, self.enabled, self.label = total, max(every, 1), enabled, label
        self.bar = None
        self.t0, self.s0 = time.time(), start
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=label, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float, tok_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total:
            elapsed = time.time() - self.t0
            rate = (step - self.s0) / elapsed if elapsed > 0 else 0.0
            eta = (self.total - step) / rate if rate > 0 else math.inf
            print(f"[{self.label}] step {step}/{self.total} loss {loss:.4f} tok/s {tok_s:,.0f} "
                  f"elapsed {elapsed:.0f}s eta {eta:.0f}s", file=sys.stderr, flush=True)

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# bf16 dense peak FLOP/s by CUDA device name (see train/dryrun.GPU_PEAK for the source).
def device_peak_flops(device: torch.device) -> float | None:
    """The device's bf16 dense peak, None for a CPU or an unlisted GPU (MFU is then not reported)."""
    from .dryrun import GPU_PEAK

    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((peak for gpu, peak in GPU_PEAK.items() if gpu in name), None)


class StepCost:
    """Model FLOPs of one optimizer step (student 6N + attention, live teacher forward 2N + attention, dryrun's
    formula) and the MFU they make per device in a measured step time.

    The teacher counts for the tokens it forwarded during the step (`kd.Teacher.take_forward_tokens`), not for every
    step: runs stepped in lockstep on one shared teacher forward (compare.share_teacher) charge it to the run whose
    step ran it, and whose step time holds it, and nothing to the others; rows a top-k cache answered cost nothing."""

    def __init__(self, hf_model: nn.Module, params: int, seq: int, tokens_per_step: int, world: int,
                 device: torch.device, teacher=None):
        from .dryrun import flops_per_token, hf_sizes

        self.student = flops_per_token(params=params, seq=seq, **hf_sizes(hf_model.config)) * tokens_per_step / world
        self.teacher, self.seq = teacher, seq
        self.peak = device_peak_flops(device)
        self._teacher_per_token: float | None = None
        self.steps, self.teacher_total = 0, 0.0  # over the steps recorded

    def teacher_flops(self) -> float:
        """The teacher's FLOPs on this device since the last call: its forwards in the step just timed."""
        tokens = self.teacher.take_forward_tokens() if self.teacher is not None else 0
        if not tokens:
            return 0.0
        if self._teacher_per_token is None:
            from .dryrun import flops_per_token, hf_sizes

            model = self.teacher.model  # loaded: it has forwarded
            n = sum(p.numel() for p in model.parameters())
            self._teacher_per_token = flops_per_token(params=n, seq=self.seq, forward_only=True,
                                                      **hf_sizes(model.config))
        return self._teacher_per_token * tokens

    def record(self, dt: float) -> dict[str, float | None]:
        """The rates of the step that took dt seconds and has just ended."""
        teacher = self.teacher_flops()
        self.steps, self.teacher_total = self.steps + 1, self.teacher_total + teacher
        return self._rates(teacher, dt)

    def mean(self, seconds: float) -> dict[str, float | None]:
        """The rates over every step recorded, which took `seconds` in all."""
        return self._rates(self.teacher_total / self.steps, seconds / self.steps)

    def _rates(self, teacher: float, dt: float) -> dict[str, float | None]:
        out = {"student_flops_per_s": self.student / dt, "teacher_flops_per_s": teacher / dt}
        mfu = (lambda f: f / dt / self.peak) if self.peak else (lambda f: None)
        out.update(mfu=mfu(self.student + teacher), mfu_student=mfu(self.student), mfu_teacher=mfu(teacher))
        return out


class HostSyncs:
    """Counts the device-to-host synchronisations inside a block on CUDA (torch's sync debug mode warns at each);
    `last` is None elsewhere: a CPU has no device to wait for. Other warnings raised in the block are re-issued."""

    def __init__(self, device: torch.device):
        self.on, self.last = device.type == "cuda", None

    @contextlib.contextmanager
    def count(self):
        if not self.on:
            yield
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        self.last = len(syncs)
        for w in caught:
            if w not in syncs:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
