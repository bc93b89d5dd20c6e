"""The training loop: one run of one variant (CE or KD), resumable, single process or torchrun (DDP / FSDP2).

Run folder layout (out_dir):
  metrics.jsonl          see metrics.py
  checkpoints/step-N/    periodic checkpoints (checkpoint.py), newest train.keep_checkpoints kept
  final/                 the checkpoint at the last step (transformers-loadable, with the tokenizer)
  result.json            the run's summary (losses, held-out loss, perplexity, tokens/s, wall time, parameters)
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ckpt
from .config import RunConfig
from .distributed import DistInfo, accumulation, all_equal, all_reduce_sum, barrier, full_state, load_full_state, \
    setup, wrap
from .metrics import AlphaStats, MetricsLog, Progress, alpha_ma_per_head, heldout_loss, qk_logit_probe, sink_logits

# Keys that may differ between a run and its resume (they change nothing computed).
RESUME_FREE_KEYS = {"train.out_dir", "train.log_every", "train.threads"}
FINAL_LOSS_WINDOW = 0.05  # final train loss = mean over the last 5% of steps (at least 1)


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("options", "rope_scaling", "extra"):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _check_resume_config(saved: dict, cfg: RunConfig) -> None:
    a, b = _flat(saved), _flat(cfg.to_dict())
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in RESUME_FREE_KEYS)
    if diff:
        detail = "; ".join(f"{k}: checkpoint {a.get(k)!r}, now {b.get(k)!r}" for k in diff[:8])
        raise ValueError(f"--resume with a different config ({detail}); resume with the run's original config")


def autocast_for(device: torch.device, precision: str):
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if not bf16:
        return contextlib.nullcontext, False
    return (lambda: torch.autocast(device.type, dtype=torch.bfloat16)), True


def train(cfg: RunConfig, out_dir: str | Path, *, resume: bool = False, base_model=None, variant: str | None = None,
          variant_options: dict | None = None, label: str | None = None, log=print) -> dict[str, Any]:
    """Train one variant into `out_dir`; returns the run summary (also written to out_dir/result.json).

    base_model: an unconverted model to start from (compare passes one per seed so all variants share weights);
    by default one is built from cfg.model and cfg.train.seed. variant/variant_options default to [variant].
    """
    from transformers.utils import logging as hf_logging

    from .data import TrainBatches, data_key, eval_sequences, open_source
    from .kd import Teacher, ce_loss
    from .model import build_base, convert, count_params
    from .optim import build_optimizer, set_lr
    from .pretrained import load_tokenizer
    from ..variants.running_stats import step_running_stats  # [running stats]

    hf_logging.disable_progress_bar()
    t_start = time.time()
    tc, dc = cfg.train, cfg.data
    variant = variant or cfg.variant.name
    opts = cfg.variant.options if variant_options is None else variant_options
    out_dir = Path(out_dir)
    info: DistInfo = setup(tc.device)
    if tc.threads:
        torch.set_num_threads(tc.threads)
    local_batch = tc.global_batch // info.world
    if tc.global_batch % (tc.micro_batch * info.world):
        raise ValueError(f"train.global_batch ({tc.global_batch}) must be a multiple of train.micro_batch "
                         f"({tc.micro_batch}) x ranks ({info.world})")
    n_micro = local_batch // tc.micro_batch
    autocast, bf16 = autocast_for(info.device, tc.precision)
    say = log if info.is_main else (lambda *a, **k: None)

    tok = load_tokenizer(dc.tokenizer)
    if len(tok) > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer {dc.tokenizer!r} has {len(tok)} tokens but model.vocab_size is "
                         f"{cfg.model.vocab_size}; set model.vocab_size >= {len(tok)}")
    source = open_source(dc.train, tok, dc, tc.seed, shuffle=dc.shuffle)
    batches = TrainBatches(source, tc.global_batch, tc.micro_batch, info.rank, info.world)
    held = eval_sequences(dc.eval, tok, dc, max(dc.eval_sequences, dc.probe_sequences)).to(info.device)

    if base_model is None:
        base_model = build_base(cfg.model, tc.seed, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        model = convert(base_model, variant, opts, copy_model=False)
    else:
        model = convert(base_model, variant, opts)
    model.to(info.device).train()
    n_params = count_params(model)
    if tc.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_model = model
    model = wrap(model, info, tc.parallel)
    optimizer = build_optimizer(model, cfg.optim)
    if tc.compile:
        model = torch.compile(model)
    teacher = None
    if cfg.kd.enabled:
        teacher = Teacher(cfg.kd, student_tok=tok, student_tok_spec=dc.tokenizer, student_vocab=cfg.model.vocab_size,
                          data_key=data_key(source, dc.seq_len), seq_len=dc.seq_len, device=info.device,
                          rank=info.rank)
    alpha_stats = AlphaStats(model)
    metrics = MetricsLog(out_dir / "metrics.jsonl", enabled=info.is_main)
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)

    start, wall0, tokens_seen = 0, 0.0, 0
    if resume:
        path = ckpt.newest_intact(out_dir, log=say)
        state = ckpt.load_training_state(path)
        ts = state["trainer_state"]
        _check_resume_config(ts["config"], cfg)
        missing = load_full_state(model, optimizer, state["model"], state["optimizer"])
        tied = {n for n in missing if n.endswith("lm_head.weight") and cfg.model.tie_embeddings}
        if set(missing) - tied:
            raise ValueError(f"checkpoint {path} lacks weights {sorted(set(missing) - tied)[:5]}")
        torch.set_rng_state(state["rng"]["torch_cpu"])
        if "torch_cuda" in state["rng"] and info.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["torch_cuda"])
        batches.load_state_dict(ts["data"])
        start, wall0, tokens_seen = ts["step"], ts["wall_time"], ts["tokens"]
        metrics.truncate_after(start)
        say(f"resuming from {path} (step {start})")
        metrics.write({"kind": "resume", "step": start, "checkpoint": str(path)})
        if start >= tc.steps:
            say(f"the run in {out_dir} is already complete ({start} steps)")
            if (out_dir / "result.json").is_file():
                return json.loads((out_dir / "result.json").read_text())
    else:
        if (out_dir / "metrics.jsonl").exists():  # every rank checks, before rank 0 writes (barrier below)
            raise ValueError(f"{out_dir} already holds a run; pass --resume to continue it or choose another --out")
        barrier(info)
        metrics.write({"kind": "config", "config": cfg.to_dict(), "variant": variant, "variant_options": opts,
                       "params": n_params, "world_size": info.world, "tokens_per_step": tc.global_batch * dc.seq_len,
                       "precision": "bf16 autocast" if bf16 else "fp32", "device": str(info.device),
                       "tokenizer": dc.tokenizer, "separator": dc.separator or tok.eos_token})

    tokens_per_step = tc.global_batch * dc.seq_len
    progress = Progress(tc.steps, start, tc.log_every, info.is_main, label=label or variant)
    t_seg = time.time()
    train_time = 0.0

    def do_eval(step: int) -> dict[str, Any]:
        model.eval()
        try:
            rec = {"kind": "eval", "step": step}
            loss = heldout_loss(model, held[:dc.eval_sequences], dc.eval_batch, autocast)
            rec.update(heldout_loss=loss, heldout_ppl=math.exp(loss))
            rec.update(qk_logit_probe(model, held[:dc.probe_sequences, :-1], autocast))
            if (a := alpha_ma_per_head(model)):
                rec["alpha_ma"] = a
            if (s := sink_logits(model)):
                rec["sinks"] = s
        finally:
            model.train()
        metrics.write(rec)
        progress.write(f"[{label or variant}] step {step}: held-out loss {rec['heldout_loss']:.4f} "
                       f"(ppl {rec['heldout_ppl']:.1f}), mean qk logit {rec['qk_logit_mean']:.3f}")
        return rec

    def save(step: int, final: bool) -> None:
        if teacher is not None:
            teacher.flush()
        msd, osd = full_state(model, optimizer)
        if info.is_main:
            state = {"step": step, "data": batches.state_dict(), "wall_time": wall0 + time.time() - t_seg,
                     "tokens": tokens_seen, "config": cfg.to_dict(), "variant": variant, "world_size": info.world}
            target = out_dir / "final" if final else out_dir / "checkpoints" / ckpt.step_name(step)
            ckpt.save(target, model=hf_model, model_sd=msd, optim_sd=osd, tokenizer=tok, trainer_state=state)
            if not final:
                ckpt.prune(out_dir, tc.keep_checkpoints)
        barrier(info)

    last_eval = do_eval(0) if start == 0 and start < tc.steps else None
    train_losses: list[float] = []
    for s in range(start, tc.steps):
        t0 = time.time()
        lr = set_lr(optimizer, s, tc.steps, cfg.optim.lr, cfg.schedule)
        rows, ids = batches.next()  # (local_batch, T + 1)
        rows = rows.to(info.device)
        sums = torch.zeros(3, dtype=torch.float64)  # loss, ce, kd (sums of micro-batch means)
        for i in range(n_micro):
            mb = rows[i * tc.micro_batch:(i + 1) * tc.micro_batch]
            inputs, targets = mb[:, :-1], mb[:, 1:]
            with accumulation(model, info, sync=i == n_micro - 1):
                with autocast():
                    logits = model(input_ids=inputs).logits  # (b, T, V)
                ce = ce_loss(logits, targets)
                kd = None
                if teacher is not None:
                    kd = teacher.loss(logits, teacher.targets(inputs, ids[i * tc.micro_batch:(i + 1) * tc.micro_batch]))
                    loss = cfg.kd.kd_alpha * kd + (1.0 - cfg.kd.kd_alpha) * ce
                else:
                    loss = ce
                (loss / n_micro).backward()
            sums += torch.tensor([float(loss.detach()), float(ce.detach()), float(kd.detach()) if kd is not None else 0.0], dtype=torch.float64)
        max_norm = cfg.optim.clip_grad_norm if cfg.optim.clip_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        optimizer.step()
        step_running_stats(hf_model)  # [running stats] one alpha_ma EMA step per optimizer step, over all ranks
        optimizer.zero_grad(set_to_none=True)
        sums = all_reduce_sum(sums.to(info.device), info).cpu() / (n_micro * info.world)
        dt = time.time() - t0
        train_time += dt
        tokens_seen += tokens_per_step
        step = s + 1
        rec = {"kind": "train", "step": step, "loss": float(sums[0]), "ce_loss": float(sums[1]), "lr": lr,
               "grad_norm": grad_norm, "tokens_per_s": tokens_per_step / dt, "tokens": tokens_seen,
               "wall_time": wall0 + time.time() - t_seg}
        if teacher is not None:
            rec["kd_loss"] = float(sums[2])
        rec.update(alpha_stats.collect(info))
        if (sk := sink_logits(model)):
            rec["sinks"] = [sum(x) / len(x) for x in sk]
        metrics.write(rec)
        train_losses.append(rec["loss"])
        progress.update(step, rec["loss"], rec["tokens_per_s"])
        if not math.isfinite(rec["loss"]):
            raise FloatingPointError(f"loss is {rec['loss']} at step {step}; lower optim.lr or check the data")
        if step == tc.steps or (tc.eval_every and step % tc.eval_every == 0):
            last_eval = do_eval(step)
        if tc.checkpoint_every and step % tc.checkpoint_every == 0 and step < tc.steps:
            save(step, final=False)
    progress.close()
    if start < tc.steps:
        save(tc.steps, final=True)
    alpha_bufs = [m.alpha_ma for m in hf_model.modules() if hasattr(m, "alpha_ma")]
    rank_diff = all_equal(torch.cat(alpha_bufs), info) if alpha_bufs else 0.0
    if info.is_main:  # the whole run's losses, including steps before a resume
        train_losses = [json.loads(line)["loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()
                        if json.loads(line).get("kind") == "train"]
    window = max(1, round(FINAL_LOSS_WINDOW * tc.steps))
    tail = train_losses[-window:]
    result = {"variant": variant, "params": n_params, "steps": tc.steps, "world_size": info.world,
              "final_train_loss": sum(tail) / len(tail) if tail else None,
              "final_loss_window": window, "last_step_loss": train_losses[-1] if train_losses else None,
              "heldout_loss": last_eval["heldout_loss"] if last_eval else None,
              "heldout_ppl": last_eval["heldout_ppl"] if last_eval else None,
              "qk_logit_mean": last_eval["qk_logit_mean"] if last_eval else None,
              "tokens_per_s": tokens_per_step * (tc.steps - start) / train_time if train_time else None,
              "train_time_s": train_time, "wall_time_s": wall0 + time.time() - t_seg,
              "process_time_s": time.time() - t_start, "alpha_ma_max_rank_diff": rank_diff}
    metrics.write({"kind": "end", "step": tc.steps, **result})
    if info.is_main:
        (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    return result
