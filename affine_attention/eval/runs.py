"""Zero-shot accuracy of every final checkpoint of a `compare` run, written where the report reads it.

Each <variant>/seed<k>/final is evaluated with lm-evaluation-harness; its accuracies (%, lm-eval's `acc`) go into
that run's result.json as "zero_shot" and into summary.json's variant entries, so Table 1 and the Claims table
show them. The offline fixture tasks are pipeline tests on a handful of hand-written samples: they are refused
here, because whatever they produce must never be reported as accuracy.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._files import atomic_write_json
from .._numbers import mean_std
from .tasks import FIXTURE_TASKS, expand_tasks
from .tasks import check_tasks as harness_check_tasks

METRIC = "acc"
# What to do instead when a task's data cannot be had before training (the fixtures are no option here).
COMPARE_DATA_HINT = ("point --include-path at task files that read local data (dataset_path: json), or run compare "
                     "without --tasks and evaluate the checkpoints later with `affine-attention eval`")


def check_tasks(tasks: str, include_path: list[str] | None = None, *, data: bool = True) -> list[str]:
    """The task names of `tasks` (aliases expanded); ValueError for the offline fixtures, then for any name
    lm-eval does not know, then (with `data`) for a task whose data cannot be had: offline and not in the local
    cache, or no hub (harness.check_task_data). Called before training, so neither a typo nor missing data costs
    a whole run."""
    names = expand_tasks(tasks)
    fixtures = [n for n in names if n in FIXTURE_TASKS or n == "fixtures"]
    if fixtures:
        raise ValueError(f"compare --tasks: {', '.join(fixtures)} are offline fixture tasks (a few hand-written "
                         "samples that test the pipeline); their scores are not accuracies and are never reported. "
                         "Use --tasks paper (needs the Hub or a datasets cache) or your own task files with "
                         "--include-path DIR")
    if data:
        from .harness import check_task_data

        return check_task_data(names, include_path, hint=COMPARE_DATA_HINT)
    return harness_check_tasks(names, include_path)


def evaluate_run(run_dir: str | Path, tasks: str, *, include_path: list[str] | None = None, batch_size: int = 8,
                 limit: int | float | None = None, log=print) -> dict[str, dict[int, dict[str, float]]]:
    """Evaluate every final checkpoint under run_dir; returns variant -> seed -> {task: accuracy %}."""
    from ..hf.load import load_model, load_tokenizer
    from .harness import evaluate, offline_reason

    names = check_tasks(tasks, include_path, data=False)  # evaluate() loads the data, and says what is missing
    offline = offline_reason(names) is not None  # decided once: an unreachable hub is not probed per checkpoint
    run_dir = Path(run_dir)
    out: dict[str, dict[int, dict[str, float]]] = {}
    for final in sorted(run_dir.glob("*/seed*/final")):
        variant, seed = final.parent.parent.name, int(final.parent.name[4:])
        log(f"[compare] zero-shot {', '.join(names)}: {variant} seed {seed}")
        model, tok = load_model(str(final)), load_tokenizer(str(final))
        res = evaluate(model, tok, names, include_path=include_path, batch_size=batch_size, limit=limit,
                       offline=offline)
        acc = {t: 100.0 * m[METRIC] for t, m in res["tasks"].items() if m.get(METRIC) is not None}
        missing = [t for t in names if t not in acc]
        if missing:
            raise ValueError(f"tasks {missing} report no '{METRIC}' (accuracy) metric; compare --tasks takes "
                             "multiple-choice tasks only")
        out.setdefault(variant, {})[seed] = acc
        result_path = final.parent / "result.json"
        result = json.loads(result_path.read_text()) if result_path.is_file() else {}
        atomic_write_json(result_path, {**result, "zero_shot": acc, "zero_shot_limit": limit})
    summary_path = run_dir / "summary.json"
    if summary_path.is_file() and out:
        summary = json.loads(summary_path.read_text())
        for variant, seeds in out.items():
            entry = summary.get("variants", {}).get(variant)
            if entry is not None:
                entry["zero_shot"] = _per_task(seeds)
        summary["zero_shot"] = {"tasks": names, "metric": METRIC, "limit": limit}
        atomic_write_json(summary_path, summary)
    return out


def _per_task(seeds: dict[int, dict[str, float]]) -> dict[str, Any]:
    tasks = sorted({t for acc in seeds.values() for t in acc})
    out = {}
    for t in tasks:
        vals = [acc[t] for _, acc in sorted(seeds.items()) if t in acc]
        mean, std, _ = mean_std(vals)
        out[t] = {"mean": mean, "std": std, "values": vals}
    return out
