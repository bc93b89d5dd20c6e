"""A run's folder: what a run writes there, the lock that keeps it to one process, the checks before it starts or
resumes, and what is read back from it (result.json, and from its metrics log the config of a restart, logged
evaluations, the final train loss)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .._files import check_writable, read_json
from .._numbers import final_window
from .config import RunConfig
from .metrics import read_log

# Run folder layout (out_dir):
#   metrics.jsonl          see metrics.py
#   checkpoints/step-N/    periodic checkpoints and the last step's (checkpoint_dcp.py), newest train.keep_checkpoints
#                          kept
#   final/                 the model at the last step, exported from its checkpoint (transformers-loadable, with the
#                          tokenizer; export.write_final)
#   result.json            the run's summary (losses, held-out loss, perplexity, tokens/s, wall time, parameters)
#   .lock                  the pid of the process that holds the folder (see RunLock)
# A new run refuses a folder holding any of RUN_FILES (nothing is replaced silently).
RUN_FILES = ("metrics.jsonl", "result.json", "final", "checkpoints")
# Keys that may differ between a run and its resume (they change nothing computed).
RESUME_FREE_KEYS = {"train.out_dir", "train.log_every", "train.threads", "train.async_checkpoint"}
LOCK_FILE = ".lock"


class RunLock:
    """Holds a run folder for this process: an exclusive fcntl.flock on <folder>/.lock until `release`.

    The OS drops a flock when the process holding it ends, however it ends, so a killed run never leaves its folder
    stuck. The file itself stays (deleting it would let two processes lock two files of one name); it names the
    holder's pid for the error a second process gets. `enabled` false (ranks other than 0 under torchrun, which
    follow rank 0): holds nothing. Without fcntl (not POSIX) a run is refused, never left unguarded."""

    def __init__(self, folder: str | Path, enabled: bool = True):
        self.folder, self.file = Path(folder), None
        if not enabled:
            return
        try:
            import fcntl
        except ModuleNotFoundError:
            raise ValueError(f"cannot lock the run folder {self.folder}: this platform has no fcntl.flock (POSIX "
                             "only); train on Linux or macOS") from None
        f = open(self.folder / LOCK_FILE, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held by another process (or by another open of it in this one)
            f.seek(0)
            holder = f.read().strip() or "unknown: it is starting"
            f.close()
            raise ValueError(f"the run folder {self.folder} is held by another run (pid {holder}); wait for it to "
                             "end or stop it, then run again (a killed run holds nothing)") from None
        except OSError as err:  # e.g. a filesystem without locks
            f.close()
            raise ValueError(f"cannot lock the run folder {self.folder} ({err.strerror}); put the run on a local "
                             "filesystem") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self.file = f

    def release(self) -> None:
        """Give the folder back (closing the file drops the flock); safe to call twice."""
        if self.file is not None:
            self.file.truncate(0)  # no stale pid for the next holder's errors
            self.file.close()
            self.file = None


def read_result(out_dir: Path) -> dict[str, Any]:
    """result.json of a finished run (read on --resume)."""
    return read_json(Path(out_dir) / "result.json", "delete it and --resume again: the run's summary is rebuilt from "
                     "its final checkpoint and metrics.jsonl")


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
    check_writable(out_dir)


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


def recorded_config(out_dir: Path) -> dict[str, Any] | None:
    """The config the run in out_dir was started with, as recorded (a comparison's config.json, else the run log's
    config record), or None when out_dir holds neither."""
    compare_json = out_dir / "config.json"
    if compare_json.is_file():
        return read_json(compare_json, "pass --config (and --set) as the run was started")
    if (out_dir / "metrics.jsonl").is_file():
        return logged_config(out_dir)
    return None


def saved_config(out_dir: Path) -> dict[str, Any]:
    """The recorded config of the run in out_dir as a raw config dict that --set overrides apply to (the default
    config of --resume). A retrofit (model.init_from) keeps only init_from and function_preserving of [model]: its
    architecture is the pretrained model's, and the other [model] keys are the defaults a loaded config reports."""
    saved = recorded_config(out_dir)
    if saved is None:
        raise ValueError(f"--resume: {out_dir} holds neither config.json nor metrics.jsonl, so the run's config is "
                         "unknown; pass --out of a run started by train or compare, or pass --config (and --set) "
                         "as the run was started")
    model = saved.get("model", {})
    if model.get("init_from"):
        saved = {**saved, "model": {k: model[k] for k in ("init_from", "function_preserving") if k in model}}
    return saved


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
    window = final_window(steps)
    tail = train_losses[-window:]
    return {"final_train_loss": sum(tail) / len(tail) if tail else None, "final_loss_window": window,
            "last_step_loss": train_losses[-1] if train_losses else None}
