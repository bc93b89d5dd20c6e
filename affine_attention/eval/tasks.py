"""The zero-shot tasks: their names and aliases, the offline fixture tasks written out as lm-eval task files, and
lm-eval's task manager checking and loading them (lm-eval itself loads lazily: importing this stays cheap)."""

from __future__ import annotations

import difflib
import json
import re
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

# The paper's zero-shot tasks (lm-eval names), in the column order of its Table 1.
PAPER_TASKS = ("winogrande", "piqa", "hellaswag", "arc_challenge", "arc_easy", "boolq")
# Rolling-perplexity stand-in for the paper's C4 perplexity, scored like lm-eval's wikitext task.
FIXTURE_PPL_TASK = "fixture_c4"
# Every fixture task: one per paper task (same order), then the perplexity one.
FIXTURE_TASKS = tuple(f"fixture_{name}" for name in PAPER_TASKS) + (FIXTURE_PPL_TASK,)
# Names that expand to a list of tasks wherever a task list is accepted.
TASK_ALIASES = {"fixtures": FIXTURE_TASKS, "paper": PAPER_TASKS}

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


def task_manager(names: list[str], include_paths: list[str], user_paths: list) -> Any:
    """lm-eval's TaskManager over `include_paths`; a ValueError names any of `names` it does not know."""
    from lm_eval.tasks import TaskManager

    # Fixture-only runs skip indexing lm-eval's ~10k built-in task files, which they do not need.
    # User folders always get it: their groups and includes may name built-in tasks.
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
    user_paths = user_task_folders(include_path)
    if user_paths or any(name not in FIXTURE_TASKS for name in names):
        with tempfile.TemporaryDirectory(prefix="affine_attention_tasks_") as tmp:
            fixture_tasks = materialize_fixture_tasks(tmp)
            task_manager(names, [str(fixture_tasks)] + [str(p) for p in user_paths], user_paths)
    return names


def user_task_folders(include_path) -> list:
    """`include_path` (None, one folder or several) as a list of folders, each checked to be one."""
    if include_path is None:
        return []
    user_paths = [include_path] if isinstance(include_path, (str, Path)) else list(include_path)
    for path in user_paths:
        if not Path(path).is_dir():
            raise ValueError(f"include_path {str(path)!r} is not a folder of task YAMLs")
    return user_paths


def _dataset_of(manager, name: str) -> tuple[str, str | None] | None:
    """(dataset_path, dataset_name) of a task, from lm-eval's index; None where it cannot say (a group, a tag, an
    lm-eval whose index keeps no config)."""
    cfg = getattr(manager.task_index.get(name), "cfg", None)
    if not isinstance(cfg, dict) or not isinstance(cfg.get("dataset_path"), str):
        return None
    return cfg["dataset_path"], cfg.get("dataset_name")


# What to do when a task's data is missing offline, for `evaluate` and `affine-attention eval`.
EVAL_DATA_HINT = (
    "use the offline fixture tasks instead ({fixtures}; `--tasks fixtures` on the command line), or pass task "
    "YAMLs that read local files (dataset_path: json, dataset_kwargs.data_files) with include_path"
)


def load_tasks(manager, names: list[str], offline_reason: str | None, hint: str = EVAL_DATA_HINT) -> list:
    """Build each requested task (this is where lm-eval loads the data); one clear line that names every task whose
    data could not be loaded. `offline_reason` says why the hub may not be used (None: online); `hint` is the
    alternative to offer, with {fixtures} standing for the fixture task names."""
    built, failures, missing = [], [], []
    for name in names:
        try:
            loaded = manager.load([name])
        except OSError as err:  # datasets' ConnectionError / FileNotFoundError / DatasetNotFoundError
            dataset = _dataset_of(manager, name)
            what = f"task {name}"
            if dataset:
                what += f": dataset {dataset[0]}" + (f" ({dataset[1]})" if dataset[1] else "")
            if offline_reason and isinstance(err, ConnectionError):
                failures.append(f"{what} is not in the local datasets cache")
                missing.append(dataset)
            else:  # a missing local file, a gated data set, ...: datasets' own words, first line
                failures.append(f"{what}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
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
        import datasets

        alternative = hint.format(fixtures=", ".join(FIXTURE_TASKS))
        if missing:
            path, config = next((d for d in missing if d), ("PATH", "NAME"))
            call = f"datasets.load_dataset({path!r}" + (f", {config!r})" if config else ")")
            todo = (f"{offline_reason}. Download the data on a machine with network (e.g. {call}) and copy its "
                    f"datasets cache to {datasets.config.HF_DATASETS_CACHE} here, or {alternative}")
        else:
            todo = f"check the network connection and the files, or {alternative}"
        raise TaskDataUnavailableError(f"cannot load the data of {'; '.join(failures)}; {todo}")
    return built
