"""Zero-shot evaluation with the real lm-evaluation-harness on an in-memory transformers model (`evaluate`): the
tasks of tasks.py run through lm-eval's HFLM adapter, the random states and offline mode kept as they were; and the
check that every task's data can be had (`check_task_data`), for commands that evaluate only after long work."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

from .tasks import EVAL_DATA_HINT, FIXTURE_TASKS, expand_tasks, load_tasks, materialize_fixture_tasks, \
    task_manager, user_task_folders

_TRUE = {"1", "ON", "YES", "TRUE"}


def is_offline() -> bool:
    """True when the environment asks for offline mode (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE /
    TRANSFORMERS_OFFLINE) or the datasets library was imported in offline mode."""
    return _offline_setting() is not None


def _offline_setting() -> str | None:
    """Which setting asks for offline mode, in words (e.g. 'HF_DATASETS_OFFLINE=1'); None when none does."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").upper() in _TRUE:
            return f"{var}={os.environ[var]}"
    import datasets

    return "datasets.config.HF_HUB_OFFLINE = True" if datasets.config.HF_HUB_OFFLINE else None


def _hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the Hugging Face hub answers one HEAD request within `timeout` (proxies honoured). The request runs in
    a thread that is waited for at most `timeout`, because a name lookup with no network ignores socket timeouts."""
    import threading
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    answered: list[bool] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout)
            answered.append(True)
        except urllib.error.HTTPError:  # an error status is still an answer: the hub can be reached
            answered.append(True)
        except (OSError, ValueError):
            answered.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered and answered[0])


def offline_reason(names: Sequence[str], offline: bool | None = None) -> str | None:
    """Why the data of `names` must come from local files or the cache, in words; None when the hub may be used.

    offline True / False decides; None follows the environment (:func:`is_offline`) and, unless only fixture tasks
    are asked for, checks that the hub answers: without network, datasets would retry each download for minutes.
    """
    if offline is not None:
        return "offline mode is on (offline=True)" if offline else None
    setting = _offline_setting()
    if setting is not None:
        return f"offline mode is on ({setting})"
    if all(name in FIXTURE_TASKS for name in names):
        return None
    from huggingface_hub import constants

    return None if _hub_reachable() else f"the hub ({constants.ENDPOINT}) is unreachable"


def check_task_data(tasks: str | Sequence[str], include_path=None, *, hint: str = EVAL_DATA_HINT) -> list[str]:
    """The expanded task names, after loading every task's data as `evaluate` will (from the local cache when
    offline or the hub is unreachable): a pre-flight check for commands that evaluate only after long work.
    Raises ValueError for an unknown name, TaskDataUnavailableError (one line, naming each task, its dataset and
    what to do; `hint` as in tasks.load_tasks) for data that cannot be had."""
    names = expand_tasks(tasks)
    user_paths = user_task_folders(include_path)
    reason = offline_reason(names)
    with tempfile.TemporaryDirectory(prefix="affine_attention_tasks_") as tmp, _hub_offline(reason is not None):
        fixture_tasks = materialize_fixture_tasks(tmp)
        manager = task_manager(names, [str(fixture_tasks)] + [str(p) for p in user_paths], user_paths)
        load_tasks(manager, names, reason, hint)
    return names


@contextlib.contextmanager
def _preserve_rng(model) -> Iterator[None]:
    """Undo lm-eval's global reseeding (python, numpy, torch) so that evaluating in the middle of a
    training run does not change the run's later random draws."""
    # numpy and torch load here, not at the top: importing affine_attention.eval stays cheap (the CLI imports it).
    import numpy as np
    import torch

    device = next(model.parameters(), torch.empty(0)).device
    cuda_devices = []
    if device.type == "cuda":
        cuda_devices = [device.index if device.index is not None else torch.cuda.current_device()]
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=cuda_devices):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


@contextlib.contextmanager
def _hub_offline(enabled: bool) -> Iterator[None]:
    """Force datasets / huggingface_hub into offline mode for the duration of the block.

    Both libraries read the offline variables once, at import; setting them later in the process
    does not reach them, and without this a lookup with no network retries until it times out.
    """
    if not enabled:
        yield
        return
    import datasets
    import huggingface_hub.constants as hub_constants

    saved = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def _quiet_git_hash() -> str | None:
    """lm-eval records the git commit of the working directory by running `git describe`, whose "fatal: not a
    git repository" reaches the user's terminal outside a repository; the same lookup, with git's stderr captured."""
    try:
        out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    return out.stdout.strip() or None


def _metric_value(value: Any) -> float | None:
    if value is None or value == "N/A":  # lm-eval's marker for "no stderr for this metric"
        return None
    return float(value)


def _compact(raw: dict) -> dict[str, dict[str, Any]]:
    """lm-eval's results -> ``{task: {metric: value, metric_stderr: value, "samples": n}}``."""
    tasks: dict[str, dict[str, Any]] = {}
    for name, metrics in raw["results"].items():
        entry: dict[str, Any] = {}
        for key, value in metrics.items():
            if "," not in key:  # "name", "alias", "sample_len": not metrics
                continue
            metric, filter_name = key.split(",", 1)
            # Filter "none" is the plain metric; other filters (generation tasks) stay visible.
            label = metric if filter_name == "none" else f"{metric},{filter_name}"
            entry[label] = _metric_value(value)
        entry["samples"] = raw.get("n-samples", {}).get(name, {}).get("effective", metrics.get("sample_len"))
        tasks[name] = entry
    return tasks


def evaluate(
    model,
    tokenizer,
    tasks: str | Sequence[str],
    *,
    offline: bool | None = None,
    batch_size: int = 8,
    limit: int | float | None = None,
    device: str | None = None,
    include_path: str | Path | Sequence[str | Path] | None = None,
) -> dict:
    """Run lm-evaluation-harness (``lm_eval.simple_evaluate`` with ``HFLM``) on ``model``.

    Args:
        model: any transformers causal LM instance (converted variants included).
        tokenizer: its tokenizer instance (lm-eval may set a pad token on it if it has none).
        tasks: lm-eval task / group / tag names, a comma-separated string of them, or the aliases
            ``fixtures`` (all of :data:`FIXTURE_TASKS`) and ``paper`` (:data:`PAPER_TASKS`). The paper
            tasks need the Hub or a local datasets cache; fixture tasks always work offline.
        offline: forbid network access for datasets. ``None``: follow the environment
            (:func:`is_offline`), and go offline when the hub does not answer. When offline, a task whose data is
            not cached raises :class:`TaskDataUnavailableError` (a ``ValueError``) naming the task and the
            alternatives.
        batch_size: requests per forward pass.
        limit: at most this many documents per task (a float < 1: that fraction). For tests only:
            limited results are not comparable with published numbers.
        device: move the model there first (in place, as ``nn.Module.to``); ``None`` keeps it where it is.
        include_path: folder(s) of your own lm-eval task YAMLs; their names override built-in and
            fixture tasks of the same name.

    Returns:
        ``{"tasks": {name: {"acc": .., "acc_stderr": .., "acc_norm": .., "acc_norm_stderr": ..,
        "samples": n}}, "config": {...}}``. Accuracies are fractions in [0, 1]; rolling-perplexity
        tasks report ``word_perplexity``, ``byte_perplexity``, ``bits_per_byte`` (stderr ``None``).
        The model's train/eval mode and the global random states (python, numpy, torch), which
        lm-eval reseeds, are restored afterwards.
    """
    import lm_eval
    import lm_eval.evaluator
    from lm_eval.models.huggingface import HFLM

    names = expand_tasks(tasks)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if limit is not None and not (isinstance(limit, (int, float)) and limit > 0):
        raise ValueError(f"limit must be a positive number or None, got {limit!r}")
    user_paths = user_task_folders(include_path)
    reason = offline_reason(names, offline)

    if device is not None:
        model.to(device)
    was_training = model.training
    with tempfile.TemporaryDirectory(prefix="affine_attention_tasks_") as tmp, _hub_offline(reason is not None):
        fixture_tasks = materialize_fixture_tasks(tmp)
        # lm-eval lets later folders override earlier ones: the user's tasks win over our fixtures.
        manager = task_manager(names, [str(fixture_tasks)] + [str(p) for p in user_paths], user_paths)
        built = load_tasks(manager, names, reason)
        try:
            # backend="causal": lm-eval cannot tell from a converted model type (affine_llama, ...) that it is a
            # causal LM and warns that it is "neither marked as CausalLM or Seq2SeqLM".
            with _preserve_rng(model), mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", _quiet_git_hash):
                lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                          backend="causal")  # sets eval mode
                raw = lm_eval.simple_evaluate(
                    model=lm, tasks=built, task_manager=manager, limit=limit, log_samples=False, batch_size=batch_size
                )
        finally:
            model.train(was_training)
    if raw is None:  # only non-zero ranks of a distributed run get None; we run single-process
        raise RuntimeError("lm-eval returned no results")
    return {
        "tasks": _compact(raw),
        "config": {
            "model": getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__,
            "tasks": names,
            "num_fewshot": raw.get("n-shot", {}),
            "limit": limit,
            "batch_size": batch_size,
            "offline": reason is not None,
            "fixture_tasks_used": [name for name in names if name in FIXTURE_TASKS],
            "lm_eval_version": getattr(lm_eval, "__version__", None),
        },
    }
