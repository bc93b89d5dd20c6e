"""`train --dry-run` and `compare --dry-run`: parameter counts, batch arithmetic, a per-term memory estimate per rank
and a throughput / MFU / wall-clock estimate for a named GPU, from the config alone (meta device, no data, no network).

Every number here is an estimate. The memory formula (per rank, bytes; b micro-batch, s sequence, P parameters, L
layers, h hidden, I intermediate, kv = KV heads x head dim, V vocabulary, e = 2 in bf16 autocast else 4, F = the
FSDP shard count, 1 without FSDP) was checked against peak RSS of the same configurations on CPU
(benchmarks/bench_dryrun.py):
  parameters     4P/F fp32 master weights
  gradients      4P/F fp32; under FSDP with accumulation also the unsharded 4P each rank keeps between rounds
  optimizer      8P/F AdamW exp_avg + exp_avg_sq; its foreach step briefly needs 4P/F more (not at the same time as
                 the activations, so the peak takes the larger of the two)
  activations    saved for backward per token per layer: 4 x 6h (residual stream and norm outputs: fp32 even under
                 autocast) + e (4h + 3kv + 4I) (q/k/v and their rotated copies, attention output, o_proj input,
                 SwiGLU's four I-wide tensors) + in bf16 2 x 2h (autocast's copies of the matmul inputs), times L; with
                 activation checkpointing only each layer's fp32 input (4h per token per layer) plus one layer's full
                 set recomputed in backward; plus one layer's backward transients e (2h + 3I) per token
  logits + loss  chunked (train.loss_chunk_tokens = c, 0 = b s; kd_chunked.py): n c V fp32, n the (c, V) tensors
                 a chunk holds at once (CE alone 1: logits, log-softmax and gradient in place; full KD 3: + the
                 teacher's logits and probabilities; top-k KD 1; + 1 for the CE's softmax when KD at T != 1 is mixed
                 with CE) + the hidden-state gradient 4 b s h + with accumulation the head gradient 4 V h (the first
                 micro-batch's is the head's .grad itself, counted in gradients)
  teacher        its weights (te = 2 or 4 bytes per teacher parameter): all of them in one process; under torchrun
                 sharded (distributed.shard_frozen): te (P_t / W + its embeddings and head, gathered for the loss, + two
                 layers, gathered one ahead), W ranks; plus one layer's forward activations and its chunk logits
A compare with a shared teacher (compare.share_teacher) keeps every variant's parameters and optimizer state resident
(compare_estimate says how much more that is) and runs the teacher once per step for all of them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .config import ModelConfig, RunConfig

# bf16 dense peak FLOP/s (NVIDIA datasheets: H100 SXM5 "1,979 TFLOPS with sparsity", H200 SXM the same Hopper
# tensor cores; dense is half of the sparse figure).
GPU_PEAK = {"h100": 989e12, "h200": 989e12}
# What a tuned trainer reaches on these GPUs (torchtitan reports 33-39% on Llama 3 8B, OLMo-core ~40%): an assumption,
# not a measurement of this trainer.
ASSUMED_MFU = 0.35
# Teacher architectures of the paper presets by hub name (their public config.json), so a dry run needs no network.
TEACHERS = {
    "meta-llama/Llama-3.2-3B": dict(arch="llama", hidden_size=3072, num_layers=28, num_heads=24, num_kv_heads=8,
                                    head_dim=128, intermediate_size=8192, vocab_size=128256, tie_embeddings=True),
    "meta-llama/Llama-3.1-8B": dict(arch="llama", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                                    head_dim=128, intermediate_size=14336, vocab_size=128256, tie_embeddings=False),
    "Qwen/Qwen1.5-1.8B": dict(arch="qwen2", hidden_size=2048, num_layers=24, num_heads=16, num_kv_heads=16,
                              head_dim=128, intermediate_size=5504, vocab_size=151936, tie_embeddings=False),
}


def _kv(mc: ModelConfig) -> int:
    return mc.num_kv_heads * (mc.head_dim or mc.hidden_size // mc.num_heads)


def _layer_params(mc: ModelConfig) -> int:
    h, d = mc.hidden_size, mc.head_dim or mc.hidden_size // mc.num_heads
    return h * mc.num_heads * d * 2 + 2 * h * _kv(mc) + 3 * h * mc.intermediate_size + 2 * h


def model_params(mc: ModelConfig) -> int:
    """Parameters of a decoder-only model of these sizes (embeddings, layers, final norm, untied head)."""
    head = 0 if mc.tie_embeddings else mc.vocab_size * mc.hidden_size
    return mc.vocab_size * mc.hidden_size + mc.num_layers * _layer_params(mc) + mc.hidden_size + head


def flops_per_token(*, params: int, layers: int, heads: int, head_dim: int, hidden: int, vocab: int, tied: bool,
                    seq: int, forward_only: bool = False) -> float:
    """Model FLOPs per token: 6 N + 12 L H Q T (PaLM appendix B, as torchtitan counts), N the matmul parameters (all
    but the input embedding; the head's matmul counts even when tied); forward only: a third of it."""
    n = params - vocab * hidden + (vocab * hidden if tied else 0)
    full = 6 * n + 12 * layers * heads * head_dim * seq
    return full / 3 if forward_only else full


def sizes(mc: ModelConfig) -> dict[str, Any]:
    """flops_per_token's size arguments of a [model] table."""
    return dict(layers=mc.num_layers, heads=mc.num_heads, head_dim=mc.head_dim or mc.hidden_size // mc.num_heads,
                hidden=mc.hidden_size, vocab=mc.vocab_size, tied=mc.tie_embeddings)


def hf_sizes(c) -> dict[str, Any]:
    """flops_per_token's size arguments of a transformers config."""
    return dict(layers=c.num_hidden_layers, heads=c.num_attention_heads,
                head_dim=getattr(c, "head_dim", 0) or c.hidden_size // c.num_attention_heads, hidden=c.hidden_size,
                vocab=c.vocab_size, tied=bool(getattr(c, "tie_word_embeddings", False)))


def teacher_config(cfg: RunConfig) -> ModelConfig | None:
    """The teacher's sizes for the estimate: a known hub name, or a local folder's config.json; None without KD or
    when the teacher cannot be read offline (the estimate then says so)."""
    if not cfg.kd.enabled or cfg.kd.top_k and cfg.kd.cache:
        return None
    if cfg.kd.teacher in TEACHERS:
        return dataclasses.replace(cfg.model, **TEACHERS[cfg.kd.teacher])
    try:
        from transformers import AutoConfig

        from ..hf.load import resolve

        path, kwargs = resolve(cfg.kd.teacher)
        c = AutoConfig.from_pretrained(path, **kwargs)
    except Exception:  # noqa: BLE001  (offline, or not a model: the estimate goes without the teacher, saying so)
        return None
    return dataclasses.replace(cfg.model, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                               num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                               head_dim=getattr(c, "head_dim", 0) or 0, intermediate_size=c.intermediate_size,
                               vocab_size=c.vocab_size, tie_embeddings=bool(c.tie_word_embeddings))


def memory_terms(cfg: RunConfig, params: int, world: int, bf16: bool,
                 teacher: ModelConfig | None = None) -> dict[str, float]:
    """Bytes per rank by the module docstring's formula; "peak" = states + max(activations + loss + teacher
    activations, optimizer step temporaries) + teacher weights."""
    mc, tc = cfg.model, cfg.train
    b, s, h, L, V, inter = tc.micro_batch, cfg.data.seq_len, mc.hidden_size, mc.num_layers, mc.vocab_size, \
        mc.intermediate_size
    F = world if tc.parallel == "fsdp" and world > 1 else 1
    n_micro = tc.global_batch // (tc.micro_batch * world)
    e, tokens = (2 if bf16 else 4), b * s
    t = {"parameters": 4 * params / F, "gradients": 4 * params / F, "optimizer": 8 * params / F}
    if F > 1:
        # FSDP2 keeps unsharded gradients between accumulation rounds, and all-gathers two layers ahead.
        t["gradients"] += 4 * params if n_micro > 1 else 0
        t["parameters"] += 2 * 4 * _layer_params(mc)
    # The residual stream and the norms' outputs stay fp32 under autocast (fp32 weights): 6 h-wide tensors at 4 bytes;
    # the projections' outputs are in e; autocast adds bf16 copies of the two norm outputs the matmuls read.
    layer = tokens * (4 * 6 * h + e * (4 * h + 3 * _kv(mc) + 4 * inter) + (2 * 2 * h if bf16 else 0))
    # checkpointed blocks (every k-th, blocks.py) keep their fp32 input; one of them is recomputed at a time
    n_ckpt = -(-L // tc.activation_checkpointing_every) if tc.activation_checkpointing else 0
    saved = tokens * 4 * h * n_ckpt + layer * (L - n_ckpt) + (layer if n_ckpt else 0)
    t["activations"] = saved + tokens * e * (2 * h + 3 * inter)
    c = min(tc.loss_chunk_tokens or tokens, tokens)
    kd = cfg.kd
    n = 1 + (2 if kd.enabled and not kd.top_k else 0) + (1 if kd.enabled and kd.temperature != 1 and kd.kd_alpha < 1
                                                         else 0)
    t["logits + loss"] = n * c * V * 4 + (4 * V * h if n_micro > 1 else 0) + 4 * tokens * h
    t["teacher weights"] = t["teacher activations"] = 0.0
    if teacher is not None:
        te = 2 if cfg.kd.teacher_dtype == "bfloat16" or (cfg.kd.teacher_dtype == "auto" and bf16) else 4
        t["teacher weights"] = te * model_params(teacher)
        if world > 1:  # sharded; the root (embeddings, head) gathered while the loss reads the head
            layers = teacher.num_layers * _layer_params(teacher)
            t["teacher weights"] = te * (model_params(teacher) / world + model_params(teacher) - layers +
                                         2 * _layer_params(teacher))
        t["teacher activations"] = tokens * te * (3 * teacher.hidden_size + 2 * teacher.intermediate_size) + \
            2 * c * teacher.vocab_size * 4
    step_temp = 4 * params / F
    live = t["activations"] + t["logits + loss"] + t["teacher activations"]
    t["peak"] = t["parameters"] + t["gradients"] + t["optimizer"] + t["teacher weights"] + max(live, step_temp)
    return t


def throughput(cfg: RunConfig, params: int, teacher: ModelConfig | None, gpu: str, world: int,
               mfu: float = ASSUMED_MFU) -> dict[str, Any]:
    """Estimated tokens/s per GPU at an assumed MFU counting student and teacher FLOPs, and the time of the run."""
    s = cfg.data.seq_len
    student = flops_per_token(params=params, seq=s, **sizes(cfg.model))
    teach = (flops_per_token(params=model_params(teacher), seq=s, forward_only=True, **sizes(teacher))
             if teacher is not None else 0.0)
    peak = GPU_PEAK[gpu]
    tok_s = mfu * peak / (student + teach)
    tokens = cfg.train.global_batch * s * cfg.train.steps
    return {"gpu": gpu, "peak_flops": peak, "assumed_mfu": mfu, "student_flops_per_token": student,
            "teacher_flops_per_token": teach, "tokens_per_s_per_gpu": tok_s,
            "student_mfu": mfu * student / (student + teach), "run_hours": tokens / (tok_s * world) / 3600}


def dry_run(cfg: RunConfig, world: int = 1, gpu: str = "h200") -> dict[str, Any]:
    from .model import base_model, convert, count_params, function_preserving, variant_options

    base = base_model(cfg, cfg.train.seed, meta=True)
    base_params = count_params(base)
    variants = list(dict.fromkeys([*cfg.compare.variants, cfg.variant.name]))
    keep = function_preserving(cfg.model)
    counts = {v: count_params(convert(base, v, variant_options(cfg, v), function_preserving=keep)) for v in variants}
    if cfg.model.init_from:  # the estimate reads the sizes of the model it starts from
        c = base.config
        dims = dict(arch=c.model_type, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                    vocab_size=c.vocab_size, intermediate_size=c.intermediate_size, num_heads=c.num_attention_heads,
                    num_kv_heads=c.num_key_value_heads, head_dim=getattr(c, "head_dim", 0) or 0)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **dims))
    tc = cfg.train
    if tc.global_batch % (tc.micro_batch * world):
        raise ValueError(f"train.global_batch ({tc.global_batch}) must be a multiple of train.micro_batch "
                         f"({tc.micro_batch}) x ranks ({world})")
    bf16 = tc.precision == "bf16" or tc.precision == "auto"  # auto means bf16 on the GPUs this estimates
    teacher = teacher_config(cfg)
    params = counts[cfg.variant.name]
    return {"arch": cfg.model.arch, "base_params": base_params, "params": counts,
            "overhead": {v: n - base_params for v, n in counts.items()},
            "tokens_per_step": tc.global_batch * cfg.data.seq_len, "world": world,
            "accumulation": tc.global_batch // (tc.micro_batch * world), "steps": tc.steps,
            "tokens_total": tc.global_batch * cfg.data.seq_len * tc.steps,
            "memory": memory_terms(cfg, params, world, bf16, teacher), "teacher": cfg.kd.teacher if teacher else None,
            "teacher_unknown": cfg.kd.enabled and teacher is None and not (cfg.kd.top_k and cfg.kd.cache),
            "throughput": throughput(cfg, params, teacher, gpu, world),
            "bf16": bf16, "parallel": tc.parallel if world > 1 else "none"}


def format_dry_run(r: dict[str, Any], variant: str) -> str:
    def m(n: int) -> str:
        return f"{n / 1e6:,.1f}M" if abs(n) >= 1e5 else f"{n:,}"

    lines = [f"architecture: {r['arch']}; base (softmax) parameters: {r['base_params']:,} ({m(r['base_params'])})"]
    for v, n in r["params"].items():
        lines.append(f"  {v:<14} {n:>16,} params  overhead {r['overhead'][v]:>+14,} ({m(r['overhead'][v])})")
    lines.append(f"tokens per step: {r['tokens_per_step']:,} (x {r['steps']:,} steps = "
                 f"{r['tokens_total'] / 1e9:,.2f}B tokens); ranks {r['world']}, gradient accumulation "
                 f"{r['accumulation']}")
    mem = r["memory"]
    lines.append(f"ESTIMATED memory per GPU for {variant!r} ({'bf16 autocast' if r['bf16'] else 'fp32'}, parallel "
                 f"{r['parallel']}; formula: affine_attention/train/dryrun.py):")
    for k, v in mem.items():
        if k != "peak" and v:
            lines.append(f"  {k:<22} {v / 2**30:8.2f} GiB")
    lines.append(f"  {'peak':<22} {mem['peak'] / 2**30:8.2f} GiB")
    if r["teacher_unknown"]:
        lines.append("  (the KD teacher's size could not be read offline: its weights and FLOPs are not included)")
    t = r["throughput"]
    lines.append(f"ESTIMATED throughput on {r['world']} x {t['gpu'].upper()} (bf16 dense peak "
                 f"{t['peak_flops'] / 1e12:.0f} TFLOP/s, ASSUMED MFU {t['assumed_mfu']:.0%} counting student "
                 f"{t['student_flops_per_token'] / 1e9:.1f} + teacher {t['teacher_flops_per_token'] / 1e9:.1f} "
                 f"GFLOP/token): {t['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU (of the {t['assumed_mfu']:.0%}, "
                 f"student {t['student_mfu']:.0%}), {t['run_hours']:,.1f} h for this run")
    return "\n".join(lines)


def compare_estimate(r: dict[str, Any], variants: int, seeds: int, shared: bool = False) -> str:
    """The wall-clock line of `compare --dry-run`: every variant x seed trained one after another, or, with a shared
    live teacher (compare.shares_teacher), a seed's variants in lockstep with one teacher forward per step."""
    t = r["throughput"]
    hours = t["run_hours"] * variants * seeds
    how = "one after another"
    if shared and t["teacher_flops_per_token"]:
        s, te = t["student_flops_per_token"], t["teacher_flops_per_token"]
        hours = t["run_hours"] * seeds * (variants * s + te) / (s + te)
        m = r["memory"]
        how = (f"in lockstep, one teacher forward per micro-batch for all; the {variants} variants' parameters and "
               f"optimizer state resident together: +{(variants - 1) * (m['parameters'] + m['optimizer']) / 2**30:.2f}"
               " GiB per GPU over the peak above")
    return (f"ESTIMATED compare wall clock: {variants} variants x {seeds} seed(s) x {r['steps']:,} steps, {how} = "
            f"{hours:,.1f} h ({hours / 24:.1f} days) on {r['world']} x {t['gpu'].upper()} at the "
            f"assumed MFU (evaluation and checkpoints not included)")

