"""A run's folder: what a run writes there, the checks before it starts or resumes, and what is read back from its
metrics log (the config of a restart, logged evaluations, the final train loss)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .config import RunConfig
from .metrics import read_log

# Run folder layout (out_dir):
#   metrics.jsonl          see metrics.py
#   checkpoints/step-N/    periodic checkpoints (checkpoint.py), newest train.keep_checkpoints kept
#   final/                 the checkpoint at the last step (transformers-loadable, with the tokenizer)
#   result.json            the run's summary (losses, held-out loss, perplexity, tokens/s, wall time, parameters)
# A new run refuses a folder holding any of them (nothing is replaced silently).
RUN_FILES = ("metrics.jsonl", "result.json", "final", "checkpoints")
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


def check_resume_config(saved: dict, cfg: RunConfig, where: str = "checkpoint") -> None:
    """The config a run was started with (`saved`, as a dict) against the one it resumes with."""
    a, b = _flat(saved), _flat(cfg.to_dict())
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in RESUME_FREE_KEYS)
    if diff:
        detail = "; ".join(f"{k}: {where} {a.get(k)!r}, now {b.get(k)!r}" for k in diff[:8])
        raise ValueError(f"--resume with a different config ({detail}); resume with the run's original config")


def check_out_dir(out_dir: Path, resume: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is an existing file, not a run folder; choose another --out")
    if resume and not out_dir.is_dir():
        raise ValueError(f"--resume: the run folder {out_dir} does not exist; pass the --out of the run to continue")


def check_no_run(out_dir: Path) -> None:
    """A new run: refuse a folder that already holds one."""
    held = [n for n in RUN_FILES if (out_dir / n).exists()]
    if held:
        raise ValueError(f"{out_dir} already holds a run ({', '.join(held)}); pass --resume to continue it "
                         "or choose another --out")


def logged_config(out_dir: Path) -> dict[str, Any]:
    """The config record of the run log in out_dir (a run killed before its first checkpoint)."""
    log_path = out_dir / "metrics.jsonl"
    logged = next((r for r in read_log(log_path) if r.get("kind") == "config"), None)
    if logged is None:
        raise ValueError(f"--resume: {log_path} holds no config record and there is no checkpoint, so this is "
                         "not a run this trainer started; pass the --out of the run to continue")
    return logged["config"]


def keep_partial_log(out_dir: Path) -> Path:
    """Move the log of a run that starts over aside as metrics.restart-N.jsonl (and drop an empty checkpoints/);
    returns where it went."""
    n = 1
    while (out_dir / f"metrics.restart-{n}.jsonl").exists():
        n += 1
    kept = out_dir / f"metrics.restart-{n}.jsonl"
    os.replace(out_dir / "metrics.jsonl", kept)
    empty = out_dir / "checkpoints"
    if empty.is_dir() and not any(empty.iterdir()):
        empty.rmdir()
    return kept


def logged_eval(out_dir: Path, step: int) -> dict[str, Any] | None:
    """The last eval record of `step` in the run log, if any."""
    found = [r for r in read_log(out_dir / "metrics.jsonl") if r.get("kind") == "eval" and r.get("step") == step]
    return found[-1] if found else None


def final_losses(out_dir: Path, steps: int, read: bool) -> dict[str, Any]:
    """The whole run's final train loss (the mean over the last FINAL_LOSS_WINDOW of the steps, steps before a
    resume included) and its last step's loss, from the log; `read` false (a rank other than 0): no losses."""
    train_losses: list[float] = []
    if read:
        train_losses = [r["loss"] for r in read_log(out_dir / "metrics.jsonl") if r.get("kind") == "train"]
    window = max(1, round(FINAL_LOSS_WINDOW * steps))
    tail = train_losses[-window:]
    return {"final_train_loss": sum(tail) / len(tail) if tail else None, "final_loss_window": window,
            "last_step_loss": train_losses[-1] if train_losses else None}
