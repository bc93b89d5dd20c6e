"""The training loop: `Trainer`, one run of one variant (CE or KD) as a handful of small named steps, resumable,
single process or torchrun (DDP / FSDP2); `train()` runs them. The run folder is described in run_dir.py."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from .._files import atomic_write_json
from ..variants.running_stats import step_running_stats
from . import checkpoint as ckpt
from . import checkpoint_dcp
from .blocks import prepare_blocks
from .config import RunConfig
from .config_load import validate
from .data import TrainBatches, data_key, eval_sequences, open_source, separator_id
from .distributed import DistInfo, all_equal, all_reduce_sum, barrier, setup, wrap
from .export import write_final
from .kd import Teacher
from .metrics import HostSyncs, MetricsLog, Progress, StepCost, TokenStats, running_buffers, state_per_layer
from .model import base_model as start_model
from .model import convert, count_params, function_preserving, tokenizer_spec
from .optim import build_optimizer, set_lr
from .pretrained import load_tokenizer
from .run_dir import RunLock, check_no_run, check_out_dir, check_resume_config, final_losses, keep_partial_log, \
    logged_config, logged_eval, read_result
from .steps import accumulate_gradients, autocast_for, clip_and_step, eval_record


class Trainer:
    """One run of one variant into `out_dir`.

    The steps, in order: build (tokenizer and data, model, optimizer, teacher, metrics), start or resume, then per
    step forward_backward -> optimizer_step -> after_optimizer_step -> log_step, evaluate / save on schedule, and
    finish (result.json).

    base_model: an unconverted model to start from (compare passes one per seed so all variants share weights);
    by default one is built from cfg.model and cfg.train.seed. variant/variant_options default to [variant].
    teacher: another run's KD teacher to share (compare's variants stepped in lockstep); by default one of its own.
    """

    def __init__(self, cfg: RunConfig, out_dir: str | Path, *, resume: bool = False, base_model=None,
                 variant: str | None = None, variant_options: dict | None = None, label: str | None = None,
                 log=print, teacher: Teacher | None = None):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.t_start = time.time()
        self.cfg, self.tc, self.dc = cfg, cfg.train, cfg.data
        self.variant = variant or cfg.variant.name
        self.options = cfg.variant.options if variant_options is None else variant_options
        self.label = label or self.variant
        self.out_dir, self.resume = Path(out_dir), resume
        check_out_dir(self.out_dir, resume)  # before anything is built or written
        validate(cfg)  # a config built in code is checked as a loaded one is
        self.info: DistInfo = setup(self.tc.device)
        self.say = log if self.info.is_main else (lambda *a, **k: None)
        self.lock: RunLock | None = None
        self.hold_folder()  # a folder that exists already: before minutes of building, so a second process stops
        try:
            self.build(base_model, teacher)
        except BaseException:
            self.close()
            raise

    # --- building -------------------------------------------------------------------------------------------
    def hold_folder(self) -> None:
        """Rank 0 holds the run folder (run_dir.RunLock) from the moment it exists until `close`: a second process
        on the same folder stops with an error naming the holder. Other ranks follow rank 0 and hold nothing."""
        if self.info.is_main and self.lock is None and self.out_dir.is_dir():
            self.lock = RunLock(self.out_dir)

    def close(self) -> None:
        """Give the run folder back and stop reading data ahead (`run` does it however it ends)."""
        if getattr(self, "batches", None) is not None:
            self.batches.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def build(self, base_model, teacher: Teacher | None = None) -> None:
        """Everything a run needs before its first step: data, model, teacher, statistics, the metrics log."""
        if self.tc.threads:
            torch.set_num_threads(self.tc.threads)
        tc, world = self.tc, self.info.world
        if tc.global_batch % (tc.micro_batch * world):
            raise ValueError(f"train.global_batch ({tc.global_batch}) must be a multiple of train.micro_batch "
                             f"({tc.micro_batch}) x ranks ({world})")
        self.n_micro = tc.global_batch // world // tc.micro_batch
        self.autocast, self.bf16 = autocast_for(self.info.device, tc.precision)
        self.tokens_per_step = tc.global_batch * self.dc.seq_len
        self.start_step, self.wall0, self.tokens_seen = 0, 0.0, 0
        self.train_time, self.last_eval = 0.0, None
        self.build_data()
        self.build_model(base_model)
        self.teacher = teacher
        if teacher is None:
            self.build_teacher()
        self.saver = checkpoint_dcp.ShardedSaver(self.info, background=tc.async_checkpoint)
        self.cost = StepCost(self.hf_model, self.n_params, self.dc.seq_len, self.tokens_per_step, world,
                             self.info.device, self.teacher)
        self.syncs, self.data_wait, self.syncs_total = HostSyncs(self.info.device), 0.0, 0
        self.token_stats = TokenStats(self.model)
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl", enabled=self.info.is_main)
        if self.info.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.hold_folder()

    def build_data(self) -> None:
        """The tokenizer, this rank's training batches and the held-out sequences (eval and probe)."""
        cfg, dc, tc, info = self.cfg, self.dc, self.tc, self.info
        self.tok_spec = tokenizer_spec(cfg)
        self.tok = load_tokenizer(self.tok_spec)
        if not cfg.model.init_from and len(self.tok) > cfg.model.vocab_size:  # init_from: checked in build_model
            raise ValueError(f"the tokenizer {dc.tokenizer!r} has {len(self.tok)} tokens but model.vocab_size is "
                             f"{cfg.model.vocab_size}; set model.vocab_size >= {len(self.tok)}")
        self.source = open_source(dc.train, self.tok, dc, tc.seed, shuffle=dc.shuffle)
        # The separator under document masking (packing.py), None to attend across documents.
        self.doc_sep = separator_id(self.tok, dc.separator) if dc.document_mask else None
        self.batches = TrainBatches(self.source, tc.global_batch, tc.micro_batch, info.rank, info.world)
        self.held = eval_sequences(dc.eval, self.tok, dc, max(dc.eval_sequences, dc.probe_sequences)).to(info.device)

    def build_model(self, base_model) -> None:
        """The converted model on this rank's device, wrapped for DDP / FSDP2 (and compiled), and its optimizer."""
        tc, keep = self.tc, function_preserving(self.cfg.model)
        if base_model is None:
            base_model = start_model(self.cfg, tc.seed, eos_token_id=self.tok.eos_token_id,
                                     pad_token_id=self.tok.pad_token_id)
            model = convert(base_model, self.variant, self.options, copy_model=False, function_preserving=keep)
        else:
            model = convert(base_model, self.variant, self.options, function_preserving=keep)
        self.vocab_size = model.config.vocab_size
        if len(self.tok) > self.vocab_size:
            raise ValueError(f"the tokenizer {self.tok_spec!r} has {len(self.tok)} tokens but the model's vocabulary "
                             f"has {self.vocab_size}; use the model's own tokenizer or a larger model.vocab_size")
        model.to(self.info.device).train()
        self.n_params = count_params(model)
        prepare_blocks(model, checkpointing=tc.activation_checkpointing, every=tc.activation_checkpointing_every,
                       compile=tc.compile)
        self.hf_model = model  # unwrapped: what checkpoints save
        self.model = wrap(model, self.info, tc.parallel, bf16=self.bf16)
        self.optimizer = build_optimizer(self.model, self.cfg.optim)

    def build_teacher(self) -> None:
        cfg, dc = self.cfg, self.dc
        self.teacher = None
        if cfg.kd.enabled:
            self.teacher = Teacher(cfg.kd, student_tok=self.tok, student_tok_spec=self.tok_spec,
                                   student_vocab=self.vocab_size, data_key=data_key(self.source, dc.seq_len),
                                   seq_len=dc.seq_len, device=self.info.device, rank=self.info.rank,
                                   doc_sep=self.doc_sep, chunk=self.tc.loss_chunk_tokens, compile=self.tc.compile,
                                   shard=self.info.enabled)

    # --- start or resume ------------------------------------------------------------------------------------
    def start(self) -> None:
        """A new run: refuse to overwrite one, then write the config record."""
        check_no_run(self.out_dir)  # every rank checks, before rank 0 writes
        barrier(self.info)
        dc = self.dc
        self.metrics.write({"kind": "config", "config": self.cfg.to_dict(), "variant": self.variant,
                            "variant_options": self.options, "params": self.n_params, "world_size": self.info.world,
                            "tokens_per_step": self.tokens_per_step,
                            "precision": "bf16 autocast" if self.bf16 else "fp32", "device": str(self.info.device),
                            "tokenizer": self.tok_spec, "separator": dc.separator or self.tok.eos_token})

    def nothing_saved(self) -> bool:
        """--resume of a run killed before its first checkpoint: its metrics.jsonl exists but no checkpoint does.
        (An empty folder, or damaged checkpoints only, still fail in `resume_from_checkpoint`.)"""
        if self.info.is_main:
            ckpt.recover_partial(self.out_dir, log=self.say)
        barrier(self.info)
        return (self.out_dir / "metrics.jsonl").is_file() and not ckpt.candidates(self.out_dir)

    def restart(self) -> None:
        """Start over from step 0 a run that saved nothing before it was killed, with its config (checked as a
        checkpoint's is); training is deterministic, so it takes the same steps. The partial log is kept beside
        as metrics.restart-N.jsonl."""
        check_resume_config(logged_config(self.out_dir), self.cfg, where="run log")
        barrier(self.info)  # every rank has read the log before rank 0 moves it
        if self.info.is_main:
            kept = keep_partial_log(self.out_dir)
            self.say(f"--resume: {self.out_dir} has no checkpoint yet (the run stopped before its first one), so it "
                     f"starts over from step 0; the partial log is kept as {kept.name}")
        barrier(self.info)  # and no rank checks the folder (start) before the log is moved
        self.start()

    def resume_from_checkpoint(self) -> None:
        """Restore weights, optimizer, RNG, data position and counters from the newest intact checkpoint."""
        if self.info.is_main:
            ckpt.recover_partial(self.out_dir, log=self.say)
        barrier(self.info)
        path = checkpoint_dcp.newest(self.out_dir, self.info, log=self.say)
        # Before any weight is read: another architecture would otherwise end in a size-mismatch error.
        check_resume_config(json.loads((path / "trainer_state.json").read_text())["config"], self.cfg)
        state = checkpoint_dcp.restore(path, self.model, self.optimizer, self.info, self.cfg.model.tie_embeddings,
                                       config=self.hf_model.config)
        self.resumed_from = path
        ts = state["trainer_state"]
        torch.set_rng_state(state["rng"]["torch_cpu"])
        if "torch_cuda" in state["rng"] and self.info.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["torch_cuda"])
        self.batches.load_state_dict(ts["data"])
        self.start_step, self.wall0, self.tokens_seen = ts["step"], ts["wall_time"], ts["tokens"]
        self.metrics.truncate_after(self.start_step)
        self.say(f"resuming from {path} (step {self.start_step})")
        self.metrics.write({"kind": "resume", "step": self.start_step, "checkpoint": str(path),
                            "checkpoint_bytes_read_per_rank": state["read"]["bytes_per_rank"],
                            "checkpoint_bytes": state["read"]["bytes_total"]})

    def begin(self) -> None:
        """After start or resume: the progress display and the wall clock of this segment of the run."""
        self.progress = Progress(self.tc.steps, self.start_step, self.tc.log_every, self.info.is_main,
                                 label=self.label)
        self.t_seg, self.tokens_seg = time.time(), self.tokens_seen

    # --- one step -------------------------------------------------------------------------------------------
    def forward_backward(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Accumulate gradients over this rank's micro-batches of rows (L, T + 1) with sequence ids (L,); returns
        (3,) sums (float64; float32 on MPS) of micro-batch means of (loss, ce, kd)."""
        return accumulate_gradients(self.model, rows, ids, n_micro=self.n_micro, micro_batch=self.tc.micro_batch,
                                    info=self.info, autocast=self.autocast, doc_sep=self.doc_sep,
                                    teacher=self.teacher, kd_alpha=self.cfg.kd.kd_alpha,
                                    temperature=self.cfg.kd.temperature, chunk=self.tc.loss_chunk_tokens)

    def optimizer_step(self) -> float:
        """Clip, step and clear the gradients; returns the global pre-clip gradient norm."""
        return clip_and_step(self.model, self.optimizer, self.cfg.optim.clip_grad_norm)

    def after_optimizer_step(self) -> None:
        """Once per optimizer step, after it: the per-step state updates outside autograd. The variants' running
        statistics (alpha_ma) take one EMA step from every micro-batch of this step on every rank."""
        step_running_stats(self.hf_model)

    def log_step(self, step: int, sums: torch.Tensor, lr: float, grad_norm: float, dt: float,
                 cost: dict[str, Any] | None = None) -> dict[str, Any]:
        """Average the losses over ranks, write the train record with the variant's statistics, update progress."""
        sums = all_reduce_sum(sums, self.info).cpu().double() / (self.n_micro * self.info.world)
        rec = {"kind": "train", "step": step, "loss": float(sums[0]), "ce_loss": float(sums[1]), "lr": lr,
               "grad_norm": grad_norm, "tokens_per_s": self.tokens_per_step / dt, "tokens": self.tokens_seen,
               "wall_time": self.wall0 + time.time() - self.t_seg}
        if self.teacher is not None:
            rec["kd_loss"] = float(sums[2])
        rec.update(cost or {})
        rec.update(self.token_stats.collect(self.info))
        rec.update(state_per_layer(self.model))
        self.metrics.write(rec)
        # One throughput figure: tokens over wall time since this segment began (evaluation and saves included).
        self.progress.update(step, rec["loss"], (self.tokens_seen - self.tokens_seg) / (time.time() - self.t_seg))
        if not math.isfinite(rec["loss"]):
            raise FloatingPointError(f"loss is {rec['loss']} at step {step}; lower optim.lr or check the data")
        return rec

    def train_step(self, s: int) -> None:
        """Optimizer step s + 1: learning rate, batch, gradients, update, logging."""
        t0 = time.time()
        lr = set_lr(self.optimizer, s, self.tc.steps, self.cfg.optim.lr, self.cfg.schedule)
        rows, ids = self.batches.next()  # (local_batch, T + 1)
        rows = rows.to(self.info.device)
        wait = time.time() - t0
        with self.syncs.count():
            sums = self.forward_backward(rows, ids)
            grad_norm = self.optimizer_step()
            self.after_optimizer_step()
        dt = time.time() - t0
        self.train_time, self.data_wait = self.train_time + dt, self.data_wait + wait
        self.syncs_total += self.syncs.last or 0
        self.tokens_seen += self.tokens_per_step
        self.log_step(s + 1, sums, lr, grad_norm, dt,
                      {"data_wait_s": wait, "host_syncs": self.syncs.last, **self.cost.record(dt)})

    # --- evaluation and checkpoints -------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, Any]:
        """Held-out loss, the query-key logit probe and the variant's per-head state, as an eval record."""
        rec = eval_record(self.model, self.held, self.dc, self.autocast, self.doc_sep, step, self.tc.loss_chunk_tokens)
        self.metrics.write(rec)
        self.progress.write(f"[{self.label}] step {step}: held-out loss {rec['heldout_loss']:.4f} "
                            f"(ppl {rec['heldout_ppl']:.1f}), mean qk logit {rec['qk_logit_mean']:.3f}")
        self.last_eval = rec
        return rec

    def save(self, step: int, final: bool) -> None:
        if self.teacher is not None:
            self.teacher.flush()
        # The data position on every rank: a rank-split stream gathers its ranks' positions (collective).
        state = {"step": step, "data": self.batches.state_dict(), "wall_time": self.wall0 + time.time() - self.t_seg,
                 "tokens": self.tokens_seen, "config": self.cfg.to_dict(), "variant": self.variant,
                 "world_size": self.info.world}
        path = self.out_dir / "checkpoints" / ckpt.step_name(step)
        # Sharded: every rank writes its part (checkpoint_dcp.py); the last step's too, so a resume finds it.
        self.saver.save(path, model=self.model, optimizer=self.optimizer, hf_model=self.hf_model, tokenizer=self.tok,
                        trainer_state=state, after=lambda: ckpt.prune(self.out_dir, self.tc.keep_checkpoints))
        if final:
            self.write_final(path)

    def write_final(self, path: Path) -> None:
        """final/, the transformers folder the report and export read: the model alone, exported from step checkpoint
        `path` by rank 0 from its shards (no optimizer state gathered anywhere). Collective."""
        self.saver.wait()
        checkpoint_dcp.on_main(lambda: write_final(path, self.out_dir / "final"), self.info)

    def on_schedule(self, step: int) -> None:
        tc = self.tc
        if step == tc.steps or (tc.eval_every and step % tc.eval_every == 0):
            self.evaluate(step)
        if tc.checkpoint_every and step % tc.checkpoint_every == 0 and step < tc.steps:
            self.save(step, final=False)

    # --- the run --------------------------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        """The run summary (whole-run losses, including steps before a resume), written to result.json."""
        tc, info, ev = self.tc, self.info, self.last_eval
        bufs = running_buffers(self.hf_model)
        rank_diff = all_equal(torch.cat([b.flatten() for b in bufs]), info) if bufs else 0.0
        result = {"variant": self.variant, "params": self.n_params, "steps": tc.steps, "world_size": info.world,
                  **final_losses(self.out_dir, tc.steps, read=info.is_main),
                  "heldout_loss": ev["heldout_loss"] if ev else None,
                  "heldout_ppl": ev["heldout_ppl"] if ev else None,
                  "qk_logit_mean": ev["qk_logit_mean"] if ev else None,
                  "tokens_per_s": (self.tokens_per_step * (tc.steps - self.start_step) / self.train_time
                                   if self.train_time else None),
                  "document_mask": self.dc.document_mask, **self.run_cost(),
                  "train_time_s": self.train_time, "wall_time_s": self.wall0 + time.time() - self.t_seg,
                  "process_time_s": time.time() - self.t_start, "running_stats_max_rank_diff": rank_diff}
        self.metrics.write({"kind": "end", "step": tc.steps, **result})
        if info.is_main:
            atomic_write_json(self.out_dir / "result.json", result)  # compare --resume trusts it by its presence
        return result

    def run_cost(self) -> dict[str, Any]:
        """MFU, data wait and host syncs over the steps this process trained (None where not measured)."""
        steps = self.tc.steps - self.start_step
        if not steps or not self.train_time:
            return {"mfu": None, "data_wait_s_per_step": None, "host_syncs_per_step": None}
        return {"mfu": self.cost.mean(self.train_time)["mfu"], "data_wait_s_per_step": self.data_wait / steps,
                "host_syncs_per_step": self.syncs_total / steps if self.syncs.on else None}

    def run(self) -> dict[str, Any]:
        """Start or resume, train to train.steps and finish; the run folder is given back however it ends."""
        try:
            return self._run()
        finally:
            self.close()

    def _run(self) -> dict[str, Any]:
        done = self.open_run()
        if done is not None:
            return done
        for s in range(self.start_step, self.tc.steps):
            self.train_step(s)
            self.on_schedule(s + 1)
        return self.close_run()

    def open_run(self) -> dict[str, Any] | None:
        """Start or resume (and the step-0 evaluation); the summary of a run that is already complete, else None."""
        tc = self.tc
        if self.resume and self.nothing_saved():
            self.restart()
        elif self.resume:
            self.resume_from_checkpoint()
            if self.start_step >= tc.steps:
                self.say(f"the run in {self.out_dir} is already complete ({self.start_step} steps)")
                if not (self.out_dir / "final").is_dir():  # killed between the last checkpoint and final/
                    self.write_final(self.resumed_from)
                if (self.out_dir / "result.json").is_file():
                    return read_result(self.out_dir)
                # Killed after final/ but before result.json: the held-out numbers of the last step, as logged
                # (or measured again on the final weights if the log lost them), then the summary.
                self.begin()
                self.last_eval = logged_eval(self.out_dir, self.start_step) or self.evaluate(self.start_step)
                self.progress.close()
                return self.finish()
        else:
            self.start()
        self.begin()
        if self.start_step == 0 and tc.steps > 0:
            self.evaluate(0)
        return None

    def close_run(self) -> dict[str, Any]:
        """After the last step: the final checkpoint and the summary."""
        self.progress.close()
        if self.start_step < self.tc.steps:
            self.save(self.tc.steps, final=True)
        return self.finish()


def train(cfg: RunConfig, out_dir: str | Path, *, resume: bool = False, base_model=None, variant: str | None = None,
          variant_options: dict | None = None, label: str | None = None, log=print) -> dict[str, Any]:
    """Train one variant into `out_dir`; returns the run summary (also written to out_dir/result.json)."""
    return Trainer(cfg, out_dir, resume=resume, base_model=base_model, variant=variant,
                   variant_options=variant_options, label=label, log=log).run()
