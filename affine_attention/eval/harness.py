"""Zero-shot evaluation with the real lm-evaluation-harness on an in-memory transformers model:
the paper's six tasks (need the Hub or a local datasets cache), offline fixture copies of them, or
your own task YAMLs.

Fixture tasks (``fixture_*``) are lm-eval's own task definitions, pulled in with ``include:``, run
on small hand-written JSONL files in the real schemas (see ``fixtures/README.md``). They check that
the pipeline works offline; their numbers say nothing about a model's quality.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any
from unittest import mock

# The paper's zero-shot tasks (lm-eval names), in the column order of its Table 1.
PAPER_TASKS = ("winogrande", "piqa", "hellaswag", "arc_challenge", "arc_easy", "boolq")
# Rolling-perplexity stand-in for the paper's C4 perplexity, scored like lm-eval's wikitext task.
FIXTURE_PPL_TASK = "fixture_c4"
# Every fixture task: one per paper task (same order), then the perplexity one.
FIXTURE_TASKS = tuple(f"fixture_{name}" for name in PAPER_TASKS) + (FIXTURE_PPL_TASK,)
# Names that expand to a list of tasks wherever a task list is accepted.
TASK_ALIASES = {"fixtures": FIXTURE_TASKS, "paper": PAPER_TASKS}

_TRUE = {"1", "ON", "YES", "TRUE"}
# Scalars of the form `LM_EVAL_TASKS/<rel>` or `FIXTURE_DATA/<rel>` in the YAML templates (only ever
# as a whole mapping value, so the rest of the YAML is left untouched).
_PLACEHOLDER = re.compile(r"(?<=: )(LM_EVAL_TASKS|FIXTURE_DATA)/(\S+)[ \t]*$", re.MULTILINE)


class TaskDataUnavailableError(ValueError):
    """A task's data set could not be loaded (typically: offline and not in the local cache)."""


def _read_fixture(rel: str) -> bytes:
    return (resources.files("affine_attention.eval") / "fixtures" / rel).read_bytes()


def _list_fixture(rel: str) -> list[str]:
    return sorted(e.name for e in (resources.files("affine_attention.eval") / "fixtures" / rel).iterdir())


def materialize_fixture_tasks(directory: str | Path) -> Path:
    """Write the fixture tasks as self-contained lm-eval task files into ``directory``.

    The folder gets the resolved YAMLs (``include:`` pointing at the installed lm-eval's real task
    file, ``data_files`` at absolute paths), the helper module they reference, and a copy of the
    JSONL data. The datasets cache for these files also lives inside the folder, so evaluating the
    fixtures leaves nothing behind in ``~/.cache``. Usable with lm-eval's own CLI too:
    ``lm_eval --include_path DIR --tasks fixture_piqa ...``. Returns the folder.
    """
    import lm_eval

    out = Path(directory).resolve()
    data_out = out / "data"
    data_out.mkdir(parents=True, exist_ok=True)
    lm_eval_tasks = Path(lm_eval.__file__).resolve().parent / "tasks"
    for name in _list_fixture("data"):
        if name.endswith(".jsonl"):
            (data_out / name).write_bytes(_read_fixture(f"data/{name}"))

    def resolve(match: re.Match) -> str:
        root = lm_eval_tasks if match.group(1) == "LM_EVAL_TASKS" else data_out
        path = root / match.group(2)
        if not path.is_file():
            # e.g. an lm-eval release that moved a task file: say which one instead of a YAML error later
            raise ValueError(f"fixture task template refers to {path}, which does not exist")
        return json.dumps(str(path))  # JSON strings are valid YAML double-quoted scalars

    for name in _list_fixture("tasks"):
        if not name.endswith((".yaml", ".py")):  # e.g. a stray __pycache__
            continue
        text = _read_fixture(f"tasks/{name}").decode("utf-8")
        if name.endswith(".yaml"):
            text = _PLACEHOLDER.sub(resolve, text)
            leftover = [line for line in text.splitlines() if not line.lstrip().startswith("#")
                        and re.search(r"\b(LM_EVAL_TASKS|FIXTURE_DATA)/", line)]
            if leftover:  # a placeholder not written as a whole value: lm-eval would fail obscurely
                raise ValueError(f"fixture template {name}: unresolved placeholder in {leftover[0]!r}")
            # Keep the datasets cache of these tiny files inside the folder (see docstring).
            cache = json.dumps(str(out / ".datasets_cache"))
            text = text.replace("dataset_kwargs:\n", f"dataset_kwargs:\n  cache_dir: {cache}\n", 1)
        (out / name).write_text(text, encoding="utf-8")
    return out


def expand_tasks(tasks: str | Sequence[str]) -> list[str]:
    """Task list from a comma-separated string or a sequence; aliases (``fixtures``, ``paper``) expanded.

    Order is kept and duplicates dropped.
    """
    names = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    out: list[str] = []
    for raw in names:
        if not isinstance(raw, str):
            raise ValueError(f"task names must be strings, got {raw!r}")
        name = raw.strip()
        if not name:
            continue
        for expanded in TASK_ALIASES.get(name, (name,)):
            if expanded not in out:
                out.append(expanded)
    if not out:
        raise ValueError("no tasks given")
    return out


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
    import random

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
    does not reach them, and without this a lookup with no network retries for ~25 s before it fails.
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


def _task_manager(names: list[str], include_paths: list[str], user_paths: list) -> Any:
    from lm_eval.tasks import TaskManager

    # Indexing lm-eval's ~10k built-in task files takes several seconds; skip it for fixture-only
    # runs. User folders always get it: their groups and includes may name built-in tasks.
    if not user_paths and all(name in FIXTURE_TASKS for name in names):
        return TaskManager(include_path=include_paths, include_defaults=False)
    manager = TaskManager(include_path=include_paths, include_defaults=True)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hints.append(f"{name!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        raise ValueError(
            f"unknown task(s): {'; '.join(hints)}. Fixture tasks: {', '.join(FIXTURE_TASKS)}; "
            "for your own task YAMLs pass their folder as include_path (lm-eval skips a YAML it "
            "cannot parse without an error: run with logging at DEBUG to see why)"
        )
    return manager


def check_tasks(tasks: str | Sequence[str], include_path=None) -> list[str]:
    """The expanded task names, after checking that lm-eval knows each one (a ValueError naming the unknown ones,
    with close matches); cheap next to a model load, so commands call it first."""
    names = expand_tasks(tasks)
    user_paths = _user_paths(include_path)
    if user_paths or any(name not in FIXTURE_TASKS for name in names):
        with tempfile.TemporaryDirectory(prefix="affine_attention_tasks_") as tmp:
            fixture_tasks = materialize_fixture_tasks(tmp)
            _task_manager(names, [str(fixture_tasks)] + [str(p) for p in user_paths], user_paths)
    return names


def _user_paths(include_path) -> list:
    if include_path is None:
        return []
    user_paths = [include_path] if isinstance(include_path, (str, Path)) else list(include_path)
    for path in user_paths:
        if not Path(path).is_dir():
            raise ValueError(f"include_path {str(path)!r} is not a folder of task YAMLs")
    return user_paths


def _quiet_git_hash() -> str | None:
    """lm-eval records the git commit of the working directory by running `git describe`, whose "fatal: not a
    git repository" reaches the user's terminal outside a repository; the same lookup, with git's stderr captured."""
    import subprocess

    try:
        out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    return out.stdout.strip() or None


def _load_tasks(manager, names: list[str], offline: bool) -> list:
    """Build each requested task (this is where lm-eval loads the data); one clear error that names
    every task whose data could not be loaded."""
    built, failures = [], []
    for name in names:
        try:
            loaded = manager.load([name])
        except OSError as err:  # datasets' ConnectionError / FileNotFoundError / DatasetNotFoundError
            failures.append(f"{name!r} ({err})")
            continue
        # Pass lm-eval the built objects so it does not load the data a second time: the group
        # itself for a group, the task for a task, every tagged task for a tag.
        if name in loaded["groups"]:
            built.append(loaded["groups"][name])
        elif name in loaded["tasks"]:
            built.append(loaded["tasks"][name])
        else:
            built.extend(loaded["tasks"].values())
    if failures:
        if offline:
            hint = (
                "offline mode is on and the data is not in the local datasets cache. Use the offline "
                f"fixture tasks instead ({', '.join(FIXTURE_TASKS)}; `--tasks fixtures` on the command "
                "line), or pass task YAMLs that read local files (dataset_path: json, "
                "dataset_kwargs.data_files) with include_path"
            )
        else:
            hint = "check the network connection, or pass task YAMLs that read local files with include_path"
        raise TaskDataUnavailableError(f"cannot load the data of task(s) {'; '.join(failures)}. {hint}")
    return built


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
    user_paths = _user_paths(include_path)
    offline = is_offline() if offline is None else bool(offline)

    if device is not None:
        model.to(device)
    was_training = model.training
    with tempfile.TemporaryDirectory(prefix="affine_attention_tasks_") as tmp, _hub_offline(offline):
        fixture_tasks = materialize_fixture_tasks(tmp)
        # lm-eval lets later folders override earlier ones: the user's tasks win over our fixtures.
        manager = _task_manager(names, [str(fixture_tasks)] + [str(p) for p in user_paths], user_paths)
        built = _load_tasks(manager, names, offline)
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


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return str(value)


def format_table(results: dict) -> str:
    """Markdown table of an :func:`evaluate` result (plus its ``perplexity`` entry, if any)."""
    lines = []
    tasks = results.get("tasks", {})
    if tasks:
        lines += ["| task | samples | metric | value | stderr |", "|---|---:|---|---:|---:|"]
        for name, entry in tasks.items():
            for metric, value in entry.items():
                if metric == "samples" or metric.endswith("_stderr") or "_stderr," in metric:
                    continue
                stderr = entry.get(metric.replace(",", "_stderr,", 1) if "," in metric else f"{metric}_stderr")
                lines.append(f"| {name} | {_fmt(entry.get('samples'))} | {metric} | {_fmt(value)} | {_fmt(stderr)} |")
        if any(name in FIXTURE_TASKS for name in tasks):
            lines += ["", "fixture_* tasks run on small hand-written fixtures: a pipeline check, not a benchmark."]
    ppl = results.get("perplexity")
    if ppl:
        if lines:
            lines.append("")
        lines += ["| perplexity source | tokens | loss | ppl |", "|---|---:|---:|---:|"]
        lines.append(f"| {ppl.get('source', '')} | {ppl['tokens']} | {_fmt(ppl['loss'])} | {_fmt(ppl['ppl'])} |")
    return "\n".join(lines) + "\n"


def write_results(results: dict, path: str | Path) -> tuple[Path, Path]:
    """Write ``results`` as JSON and a markdown table; returns ``(json_path, md_path)``.

    ``path`` is either a ``.json`` file (the table goes beside it as ``.md``) or a folder (created if
    needed; files ``results.json`` and ``results.md``).
    """
    path = Path(path)
    if path.suffix == ".json":
        json_path = path
    else:
        json_path = path / "results.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    md_path = json_path.with_suffix(".md")
    json_path.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    md_path.write_text(format_table(results), encoding="utf-8")
    return json_path, md_path
