"""`train --dry-run`: build the model on the meta device and print parameter counts (total and each variant's
overhead), tokens per step, the batch arithmetic and a per-GPU memory estimate. No data, no weights, no network."""
from __future__ import annotations

from typing import Any

from .config import RunConfig


def dry_run(cfg: RunConfig, world: int = 1) -> dict[str, Any]:
    import dataclasses

    from .model import base_model, convert, count_params, function_preserving, memory_estimate, variant_options

    base = base_model(cfg, cfg.train.seed, meta=True)
    base_params = count_params(base)
    variants = list(dict.fromkeys([*cfg.compare.variants, cfg.variant.name]))
    keep = function_preserving(cfg.model)
    counts = {v: count_params(convert(base, v, variant_options(cfg, v), function_preserving=keep)) for v in variants}
    if cfg.model.init_from:  # the estimate reads the sizes of the model it starts from
        c = base.config
        sizes = dict(arch=c.model_type, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                     vocab_size=c.vocab_size, intermediate_size=c.intermediate_size, num_heads=c.num_attention_heads,
                     num_kv_heads=c.num_key_value_heads, head_dim=getattr(c, "head_dim", 0) or 0)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **sizes))
    tc = cfg.train
    if tc.global_batch % (tc.micro_batch * world):
        raise ValueError(f"train.global_batch ({tc.global_batch}) must be a multiple of train.micro_batch "
                         f"({tc.micro_batch}) x ranks ({world})")
    bf16 = tc.precision == "bf16" or tc.precision == "auto"  # auto means bf16 on the GPUs this estimates
    mem = memory_estimate(cfg, counts[cfg.variant.name], world, bf16)
    return {"arch": cfg.model.arch, "base_params": base_params, "params": counts,
            "overhead": {v: n - base_params for v, n in counts.items()},
            "tokens_per_step": tc.global_batch * cfg.data.seq_len, "world": world,
            "accumulation": tc.global_batch // (tc.micro_batch * world),
            "tokens_total": tc.global_batch * cfg.data.seq_len * tc.steps,
            "memory_gib": {"states": mem.states / 2**30, "activations": mem.activations / 2**30,
                           "logits": mem.logits / 2**30, "total": mem.total / 2**30},
            "bf16": bf16, "parallel": tc.parallel if world > 1 else "none"}


def format_dry_run(r: dict[str, Any], variant: str) -> str:
    def m(n: int) -> str:
        return f"{n / 1e6:,.1f}M" if abs(n) >= 1e5 else f"{n:,}"

    lines = [f"architecture: {r['arch']}; base (softmax) parameters: {r['base_params']:,} ({m(r['base_params'])})"]
    for v, n in r["params"].items():
        lines.append(f"  {v:<14} {n:>16,} params  overhead {r['overhead'][v]:>+14,} ({m(r['overhead'][v])})")
    mem = r["memory_gib"]
    lines += [
        f"tokens per step: {r['tokens_per_step']:,} (x {r['tokens_total'] // r['tokens_per_step']:,} steps = "
        f"{r['tokens_total'] / 1e9:,.2f}B tokens); ranks {r['world']}, gradient accumulation {r['accumulation']}",
        f"memory per GPU for {variant!r} ({'bf16 autocast' if r['bf16'] else 'fp32'}, parallel {r['parallel']}): "
        f"~{mem['total']:.1f} GiB = states {mem['states']:.1f} + activations {mem['activations']:.1f} + "
        f"logits {mem['logits']:.1f} (rough formula: affine_attention/train/model.py; a live KD teacher is extra)",
    ]
    return "\n".join(lines)
