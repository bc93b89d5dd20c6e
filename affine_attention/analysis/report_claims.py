"""The report's Claims section: a run's per-seed numbers put through claims.py's rule for each method, as one table
per method and, machine-readable, in summary.json."""
from __future__ import annotations

import json
from pathlib import Path

from .._files import atomic_write_json
from ..variants import REFERENCE as BASELINE
from ..variants import REGISTRY
from . import claims
from .compare_run import BEFORE, SeedRun, output_scale
from .report_template import Heading, Table

__all__ = ["claims_data", "claims_blocks", "claims_lines", "record_claims", "run_claims_text"]


def claims_data(runs: dict[str, list[SeedRun]], numbers: dict, gwin: tuple[int, int], by_seed: dict,
                length: int, sink: tuple[bool | None, str] | None = None, extra: dict | None = None) -> dict:
    """The Claims table's data (see claims.py): for each method, rows against the baseline and its first control
    in the run; plus the rule and whether the baseline formed an attention sink.

    numbers: Table 1's per-seed losses; gwin: the gradient statistics' window; by_seed: variant -> seed ->
    LayerRecords of the final checkpoints ({} without attention diagnostics); length: their window length. sink:
    (whether the baseline formed a sink, the test in words) where a more specific test than claims.baseline_sink's
    applies (the Bigram-Backcopy probe: its dormant queries); extra: variant -> seed -> {metric: value} of further
    attention metrics (the probe's dormant_first_token_mass)."""
    grad = {v: {r.seed: g for r in rs if (g := r.grad_stats(gwin)) is not None} for v, rs in runs.items()}
    att = {v: {s: claims.attention_scalars(recs, output_scale(runs, v, s)) for s, recs in per.items()}
           for v, per in by_seed.items() if v != BEFORE}
    for v, per in (extra or {}).items():
        for seed, values in per.items():
            att.setdefault(v, {}).setdefault(seed, {}).update(values)
    zs = {v: {r.seed: r.zero_shot() for r in rs} for v, rs in runs.items()}
    per_seed = claims.run_per_seed(numbers, grad, att, zs)
    criterion = None
    if sink is not None:
        sink, criterion = sink
    else:
        sink = claims.baseline_sink(att.get(BASELINE, {}), length)
    out = {"rule": claims.RULE_TEXT + (f" This run's sink test replaces that one: {criterion}." if criterion else ""),
           "baseline": BASELINE, "baseline_sink": sink, "sink_criterion": criterion, "methods": {}}
    for v in runs:
        if REGISTRY.get(v) is None or REGISTRY[v].role != "method":
            continue
        ctrl = next((c for c in REGISTRY[v].controls if c in runs), None)
        out["methods"][v] = {"control": ctrl, "rows": claims.claim_rows(per_seed, method=v, baseline=BASELINE,
                                                                        control=ctrl, baseline_sink=sink,
                                                                        sink_criterion=criterion)}
    return out


def claims_blocks(data: dict) -> list:
    """The report's Claims section from `claims_data`: one table per method, in run order."""
    if not data["methods"]:
        return []

    def cell(side: dict) -> str:
        d = side["diff"]
        if d["n"] == 0:
            return "-"
        spread = f" ± {d['std']:.3g}" if d["std"] is not None else ""
        return f"{d['mean']:+.3g}{spread} (n={d['n']})"

    out = [Heading("Claims")]
    for method, m in data["methods"].items():
        ctrl = m["control"] or "control"
        notes: list[str] = []

        def verdict(side: dict) -> str:
            # The verdict stays a few words so the table fits a page; its reason becomes a numbered note below the
            # table (one number per distinct reason), which the reader finds by the marker.
            if not side.get("why"):
                return claims.marked(side["verdict"])
            if side["why"] not in notes:
                notes.append(side["why"])
            return f"{claims.marked(side['verdict'])} [{notes.index(side['why']) + 1}]"

        rows = [[r["text"], r["metric"], cell(r["baseline"]), verdict(r["baseline"]), cell(r["control"]),
                 verdict(r["control"])] for r in m["rows"]]
        out.append(Table(["paper's claim", "measured as", f"{method} − {BASELINE}", "verdict",
                          f"{method} − {ctrl}", "verdict"], rows, data["rule"],
                         f"The paper's claims for {method}, against {BASELINE} and against {ctrl}", notes=notes,
                         wrap_columns=(0, 1, 2, 4)))
    return out


def claims_lines(data: dict) -> list[str]:
    """The Claims verdicts as plain lines (compare prints them at its end), from `claims_data` or summary.json's
    "claims": one line per method, claim and reference."""
    out = []
    for method, m in data.get("methods", {}).items():
        for r in m["rows"]:
            for side in ("baseline", "control"):
                ref = r[side].get("against") or (data.get("baseline") if side == "baseline" else m["control"])
                if ref is None:
                    continue
                d = r[side]["diff"]
                diff = "" if not d.get("n") else f" ({method} − {ref} = {d['mean']:+.3g}, n={d['n']})"
                out.append(f"  {method} vs {ref}: {r['text']}: {claims.marked(r[side]['verdict'])}{diff}")
    return out


def run_claims_text(run_dir: str | Path) -> str:
    """The Claims verdicts a report recorded in run_dir/summary.json, as the closing lines of `compare` and
    `report`; empty when none were recorded."""
    path = Path(run_dir) / "summary.json"
    data = json.loads(path.read_text()).get("claims") if path.is_file() else None
    lines = claims_lines(data) if data else []
    return "\n".join(["Claims (verdicts by the rule stated in the report's Claims section):", *lines]) if lines else ""


def record_claims(run_dir: Path, summary: dict, data: dict, extra: dict | None = None) -> None:
    """The Claims table (and `extra` sections, e.g. the sink probe's), machine-readable, in summary.json (rewritten
    atomically) when the run has one."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return
    atomic_write_json(path, {**summary, "claims": data, **(extra or {})})
