"""Zero-shot evaluation with the real lm-evaluation-harness on an in-memory transformers model (`evaluate`): the
tasks of tasks.py run through lm-eval's HFLM adapter, the random states and offline mode kept as they were."""

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

from .tasks import FIXTURE_TASKS, expand_tasks, load_tasks, materialize_fixture_tasks, task_manager, \
    user_task_folders

_TRUE = {"1", "ON", "YES", "TRUE"}


def is_offline() -> bool:
    """True when the environment asks for offline mode (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE /
    TRANSFORMERS_OFFLINE) or the datasets library was imported in offline mode."""
    variables = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    if any(os.environ.get(var, "").upper() in _TRUE for var in variables):
        return True
    import datasets

    return bool(datasets.config.HF_HUB_OFFLINE)


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
            (:func:`is_offline`). When offline, a task whose data is not cached raises
            :class:`TaskDataUnavailableError` (a ``ValueError``) naming the task and the alternatives.
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
    offline = is_offline() if offline is None else bool(offline)

    if device is not None:
        model.to(device)
    was_training = model.training
    with tempfile.TemporaryDirectory(prefix="affine_attention_tasks_") as tmp, _hub_offline(offline):
        fixture_tasks = materialize_fixture_tasks(tmp)
        # lm-eval lets later folders override earlier ones: the user's tasks win over our fixtures.
        manager = task_manager(names, [str(fixture_tasks)] + [str(p) for p in user_paths], user_paths)
        built = load_tasks(manager, names, offline)
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
            "offline": offline,
            "fixture_tasks_used": [name for name in names if name in FIXTURE_TASKS],
            "lm_eval_version": getattr(lm_eval, "__version__", None),
        },
    }
