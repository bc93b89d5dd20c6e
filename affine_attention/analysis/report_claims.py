"""The report's Summary and Claims sections: a run's per-seed numbers put through claims.py's rule for each method, as
one table per method (the paper's method's opens the report, with its verdicts in words) and, machine-readable, in
summary.json."""
from __future__ import annotations

import json
from pathlib import Path

from .._files import atomic_write_json
from ..variants import REFERENCE as BASELINE
from ..variants import REGISTRY
from . import claims
from .compare_run import BEFORE, SeedRun, output_scale
from .report_template import Heading, Para, Table

__all__ = ["claims_data", "claims_table", "summary_blocks", "claims_blocks", "claims_lines", "record_claims",
           "run_claims_text"]


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
    heads = {a["heads_per_layer"] for per in att.values() for a in per.values() if a.get("heads_per_layer")}
    untestable = {}
    if heads and max(heads) == 1:
        untestable["heads"] = ("one head per layer: the spread of head masses would compare layers, not heads, so "
                               "head utilisation cannot be read here")
    out = {"rule": claims.RULE_TEXT + (f" This run's sink test replaces that one: {criterion}." if criterion else ""),
           "baseline": BASELINE, "baseline_sink": sink, "sink_criterion": criterion, "methods": {}}
    for v in runs:
        if REGISTRY.get(v) is None or REGISTRY[v].role != "method":
            continue
        ctrl = next((c for c in REGISTRY[v].controls if c in runs), None)
        out["methods"][v] = {"control": ctrl, "rows": claims.claim_rows(per_seed, method=v, baseline=BASELINE,
                                                                        control=ctrl, baseline_sink=sink,
                                                                        sink_criterion=criterion,
                                                                        untestable=untestable)}
    return out


def _cell(side: dict) -> str:
    d = side["diff"]
    if d["n"] == 0:
        return "-"
    spread = f" ± {d['std']:.3g}" if d["std"] is not None else ""
    return f"{d['mean']:+.3g}{spread} (n={d['n']})"


def claims_table(data: dict, method: str, title: str | None = None) -> Table:
    """One method's claims from `claims_data`: the paired effect (mean ± std, n) and verdict against the baseline
    and against its control, the metric's minimum effect, and a numbered note per distinct reason."""
    m = data["methods"][method]
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

    rows = [[r["text"], r["metric"], "-" if r.get("min_effect") is None else f"{r['min_effect']:.3g}",
             _cell(r["baseline"]), verdict(r["baseline"]), _cell(r["control"]), verdict(r["control"])]
            for r in m["rows"]]
    return Table(["paper's claim", "measured as", "min. effect", f"{method} − {BASELINE}", "verdict",
                  f"{method} − {ctrl}", "verdict"], rows, data["rule"],
                 title or f"The paper's claims for {method}, against {BASELINE} and against {ctrl}", notes=notes,
                 wrap_columns=(0, 1, 3, 5))


def _in_words(data: dict, method: str) -> list[str]:
    """The verdicts of one method's claims grouped by verdict, one sentence per reference: the answer in words."""
    m = data["methods"][method]
    out = []
    for side in ("baseline", "control"):
        ref = data["baseline"] if side == "baseline" else m["control"]
        if ref is None:
            continue
        n = max((r[side]["diff"]["n"] for r in m["rows"]), default=0)
        groups: dict[str, list[str]] = {}
        for r in m["rows"]:
            groups.setdefault(r[side]["verdict"], []).append(r["text"])
        said = "; ".join(f"{claims.marked(v)}: {', '.join(groups[v])}" for v in claims.VERDICT_MARKS if v in groups)
        out.append(f"{method} against {ref} ({n} paired seed{'s' if n != 1 else ''}): {said}.")
    return out


def summary_blocks(data: dict, method: str) -> list:
    """The report's opening: the paper's method's claims in words, then its table (effects, spreads, n, verdicts,
    notes, the rule); the evidence follows in the report."""
    if method not in data["methods"]:
        return []
    return [Heading("Summary"), *map(Para, _in_words(data, method)),
            claims_table(data, method, f"Summary. The paper's claims for {method}: effect (mean ± sample std over "
                                       "paired seeds, n) and verdict")]


def claims_blocks(data: dict, skip: tuple[str, ...] = ()) -> list:
    """The report's Claims section from `claims_data`: one table per method in run order, but those in `skip`
    (already in the Summary)."""
    methods = [m for m in data["methods"] if m not in skip]
    if not methods:
        return []
    out: list = [Heading("Claims")]
    if skip:
        out.append(Para(f"The claims for {', '.join(skip)} open the report (Summary); the same rule for the other "
                        "methods:"))
    for method in methods:
        out += [*map(Para, _in_words(data, method)), claims_table(data, method)]
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
    head = "Claims (verdicts by the rule stated under the report's claims tables):"
    return "\n".join([head, *lines]) if lines else ""


def record_claims(run_dir: Path, summary: dict, data: dict, extra: dict | None = None) -> None:
    """The Claims table (and `extra` sections, e.g. the sink probe's), machine-readable, in summary.json (rewritten
    atomically) when the run has one."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return
    atomic_write_json(path, {**summary, "claims": data, **(extra or {})})
