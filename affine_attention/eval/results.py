"""Writing evaluation results: a markdown table of an `evaluate` result (and perplexity), and the JSON + table
files."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .tasks import FIXTURE_TASKS


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
