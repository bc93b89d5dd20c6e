"""AdamW with weight decay on matrices only, and the learning-rate schedules (warmup-stable-decay, cosine, constant).

Weight decay (decision): decay every parameter with two or more dimensions (attention and MLP projections, an untied
LM head, the variants' alpha_proj and gate_proj matrices); no decay for biases, norm weights, per-head vectors such
as the sink logits, and token embeddings. Embeddings are excluded by default (as in OLMo 2) because decay pulls
rarely seen token rows towards zero between their few updates; a head tied to the embedding is the embedding and
follows it. `optim.decay_embeddings = true` decays them too. Buffers (alpha_ma) are not parameters.

Schedules give a factor on the peak lr for the 0-based step s of `total` steps:
- warmup (all kinds): (s + 1) / warmup for s < warmup, so the last warmup step reaches the peak.
- wsd: 1 until the decay starts at d = total - round(decay_fraction * total) (never inside the warmup), then
  p = (s - d) / (total - d) and factor = 1 - (1 - m) p ("linear") or m + (1 - m)(1 - sqrt(p)) ("1-sqrt",
  Haegele et al. 2024), m = min_lr_ratio: the first decay step is at the peak and the factor would reach m at
  step `total`, one past the last step, so no step trains at exactly m.
- cosine: after warmup, m + (1 - m) (1 + cos(pi p)) / 2 with p = (s - warmup) / (total - warmup).
- constant: 1 after warmup.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .config import OptimConfig, ScheduleConfig


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Two AdamW groups, 'decay' and 'no_decay', each with a `names` list (for tests and logs)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, decay_names, no_decay_names = [], [], [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():  # tied parameters are listed once
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        is_matrix = p.ndim >= 2 and (cfg.decay_embeddings or id(p) not in embeddings)
        (decay if is_matrix else no_decay).append(p)
        (decay_names if is_matrix else no_decay_names).append(name)
    return [
        {"params": decay, "weight_decay": cfg.weight_decay, "names": decay_names, "group": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "names": no_decay_names, "group": "no_decay"},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    groups = [{k: v for k, v in g.items() if k != "names"} for g in param_groups(model, cfg)]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def lr_factor(step: int, total: int, cfg: ScheduleConfig) -> float:
    """Multiplier of the peak lr at 0-based `step` of `total` steps (see the module docstring)."""
    if total <= 0 or step < 0:
        raise ValueError(f"lr_factor needs 0 <= step and total > 0, got step={step}, total={total}")
    w = cfg.warmup_steps
    if step < w:
        return (step + 1) / w
    m = cfg.min_lr_ratio
    if cfg.kind == "constant":
        return 1.0
    if cfg.kind == "cosine":
        span = max(total - w, 1)
        p = min((step - w) / span, 1.0)
        return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p))
    decay_steps = round(cfg.decay_fraction * total)
    start = max(total - decay_steps, w)
    if step < start or total == start:
        return 1.0
    p = min((step - start) / (total - start), 1.0)
    if cfg.decay_shape == "linear":
        return 1.0 - (1.0 - m) * p
    return m + (1.0 - m) * (1.0 - math.sqrt(p))


def set_lr(optimizer: torch.optim.Optimizer, step: int, total: int, peak: float, cfg: ScheduleConfig) -> float:
    """Set every group's lr for `step` and return it. The lr is a pure function of the step, so resuming needs
    no scheduler state."""
    lr = peak * lr_factor(step, total, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
