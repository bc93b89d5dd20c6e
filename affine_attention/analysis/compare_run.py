"""Reading a `compare` run directory back (summary.json, <variant>/seed<k>/metrics.jsonl, result.json, final/): its
seed runs and the per-run numbers that the report's tables, figures and claims share."""
from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .._files import COMPARISON, log_records, notice_unlisted, read_comparison
from .._numbers import final_window
from ..variants import REFERENCE as BASELINE
from ..variants import REGISTRY
from . import gradstats

__all__ = ["BEFORE", "SeedRun", "load_run", "run_config", "reference_run", "run_steps", "role_of", "is_control",
           "final_train_loss", "heldout", "zero_shot_accuracies", "grad_window", "output_scale", "scalar"]
BEFORE = "pretrained (before)"  # the attention records of the model a retrofit started from
# Roles, control pairs and what each control isolates come from the variant registry; a run may hold names no longer
# registered (read as baselines).


@dataclass
class SeedRun:
    """One (variant, seed) run: its folder, step and eval records and result.json."""

    variant: str
    seed: int
    path: Path
    train: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    header: dict = field(default_factory=dict)
    result: dict = field(default_factory=dict)

    @property
    def final(self) -> Path:
        return self.path / "final"

    @property
    def params(self) -> int | None:
        return self.result.get("params") or self.header.get("params")

    def series(self, key: str, kind: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of a scalar key; list-valued keys (per layer) are averaged."""
        recs = self.train if kind == "train" else self.evals
        pts = [(r["step"], scalar(r[key])) for r in recs if key in r and scalar(r[key]) is not None]
        return np.array([p[0] for p in pts], dtype=float), np.array([p[1] for p in pts], dtype=float)

    def grad_stats(self, window: tuple[int, int]) -> dict | None:
        """gradstats of the pre-clip gradient norm over `window`; None when the run logged no gradient norm."""
        if not any("grad_norm" in t for t in self.train):
            return None
        return gradstats.stats_from_file(self.path / "metrics.jsonl", window=window)

    def zero_shot(self) -> dict[str, float]:
        """task -> accuracy (%) from result.json "zero_shot" (entries that are not numbers left out)."""
        return {t: s for t, a in (self.result.get("zero_shot") or {}).items() if (s := scalar(a)) is not None}


def scalar(v) -> float | None:
    """A number as a float; a list (per layer) as the mean of its finite entries; anything else None."""
    if isinstance(v, list):
        flat = [x for x in np.ravel(np.array(v, dtype=float)) if math.isfinite(x)]
        return float(np.mean(flat)) if flat else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _read_metrics(run: SeedRun) -> None:
    """The run's records, read as the trainer reads them (`_files.log_records`: a last line cut by a kill skipped)."""
    for _, rec in log_records(run.path / "metrics.jsonl"):
        kind = rec.get("kind", "train")
        if kind == "config":
            run.header = rec
        elif kind == "eval":
            run.evals.append(rec)
        elif kind == "train" and "step" in rec:
            run.train.append(rec)


def _listed_runs(run_dir: Path, summary: dict) -> list[tuple[str, int]]:
    """(variant, seed) of every run the folder's manifest (comparison.json) lists and that has a log, in run order;
    other <variant>/seed<k> folders are named, never read. A folder from before manifests: every run found, with a
    notice that says so."""
    found = {(p.parent.parent.name, int(p.parent.name[4:])) for p in run_dir.glob("*/seed*/metrics.jsonl")
             if p.parent.name[4:].isdigit()}
    manifest = read_comparison(run_dir)
    if manifest is not None:
        listed = [(v, k) for k in range(manifest["seeds"]) for v in manifest["variants"]]
        notice_unlisted(run_dir, [f"{v}/seed{k}" for v, k in sorted(found - set(listed))], COMPARISON)
        return sorted((vk for vk in listed if vk in found), key=lambda vk: (manifest["variants"].index(vk[0]), vk[1]))
    if found:
        print(f"notice: {run_dir} has no {COMPARISON} (a comparison of an older version): reading every "
              "<variant>/seed<k> it holds", file=sys.stderr, flush=True)
    order = list(summary.get("variants", {})) or list(summary.get("config", {}).get("compare", {}).get("variants", []))
    order += [v for v in sorted({v for v, _ in found}) if v not in order]
    return sorted(found, key=lambda vk: (order.index(vk[0]), vk[1]))


def load_run(run_dir: str | Path) -> tuple[dict, dict[str, list[SeedRun]]]:
    """(summary.json as a dict ({} if absent), variant -> its seed runs in seed order), variants in run order; only
    the runs its manifest lists (`_listed_runs`)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    runs: dict[str, list[SeedRun]] = {}
    for variant, seed in _listed_runs(run_dir, summary):
        path = run_dir / variant / f"seed{seed}"
        run = SeedRun(variant, seed, path)
        _read_metrics(run)
        if (path / "result.json").is_file():
            run.result = json.loads((path / "result.json").read_text())
        runs.setdefault(variant, []).append(run)
    if not runs:
        raise ValueError(f"{run_dir} holds no <variant>/seed<k>/metrics.jsonl: is it a `compare` run directory?")
    return summary, runs


def run_config(summary: dict, runs: dict[str, list[SeedRun]]) -> dict:
    """The run's config: summary.json's, else the first seed run's metrics header ({} if neither has one)."""
    return summary.get("config") or next(iter(runs.values()))[0].header.get("config") or {}


def reference_run(runs: dict[str, list[SeedRun]]) -> SeedRun:
    """The first seed run of the reference variant (variants.REFERENCE), else the run's first seed run."""
    return (runs.get(BASELINE) or next(iter(runs.values())))[0]


def run_steps(runs: dict[str, list[SeedRun]]) -> int | None:
    """Training steps of the run (result.json, else the last logged step of its first seed run)."""
    first = next(iter(runs.values()))[0]
    return first.result.get("steps") or (first.train[-1]["step"] if first.train else None)


def role_of(name: str) -> str:
    """The variant's registered role; a name no longer registered reads as a baseline."""
    return REGISTRY[name].role if name in REGISTRY else "baseline"


def is_control(name: str) -> bool:
    return role_of(name) == "control"


def final_train_loss(r: SeedRun) -> float | None:
    """result.json's final train loss, else the mean over the last FINAL_LOSS_WINDOW of the logged steps."""
    if r.result.get("final_train_loss") is not None:
        return r.result["final_train_loss"]
    losses = [t["loss"] for t in r.train if "loss" in t]
    return statistics.fmean(losses[-final_window(len(losses)):]) if losses else None


def heldout(r: SeedRun, key: str) -> float | None:
    """result.json's value of `key`, else the last evaluation's."""
    if r.result.get(key) is not None:
        return r.result[key]
    evals = [e[key] for e in r.evals if key in e]
    return evals[-1] if evals else None


def zero_shot_accuracies(summary_entry: dict, seed_runs: list[SeedRun]) -> dict[str, list[float]]:
    """task -> per-seed accuracies (%), from result.json "zero_shot" {task: acc} or summary.json."""
    out: dict[str, list[float]] = {}
    for r in seed_runs:
        for task, acc in r.zero_shot().items():
            out.setdefault(task, []).append(acc)
    if not out:
        for task, v in (summary_entry.get("zero_shot") or {}).items():
            vals = v.get("values") if isinstance(v, dict) else [v]
            out[task] = [x for x in (vals or [v.get("mean")]) if x is not None]
    return out


def grad_window(runs: dict[str, list[SeedRun]], window: int) -> tuple[tuple[int, int], str]:
    """The gradient statistics' step window (the first `window` steps, or all of a shorter run) and its label."""
    last = max((int(r.train[-1]["step"]) for rs in runs.values() for r in rs if r.train), default=0)
    first = min((int(r.train[0]["step"]) for rs in runs.values() for r in rs if r.train), default=0)
    if last < window:
        return (0, last + 1), f"all {last - first + 1} logged steps ({first}-{last}; the run is shorter than {window})"
    return (0, window + 1), f"steps {first}-{window}"


def output_scale(runs: dict[str, list[SeedRun]], variant: str, seed: int) -> float:
    """1 / the factor a function-preserving conversion started this run's attention weights at (1 when the run
    was not a retrofit, or its variant does not scale its weights)."""
    for r in runs.get(variant, []):
        if r.seed == seed and (r.final / "config.json").is_file():
            spec = json.loads((r.final / "config.json").read_text()).get("affine_attention") or {}
            return 1.0 / float((spec.get("retrofit") or {}).get("weight_scale", 1.0))
    return 1.0
