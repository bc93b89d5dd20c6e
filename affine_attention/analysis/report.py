"""`write_report(run_dir)`: report.md and a self-contained report.html for a `compare` run directory, rebuilt from
its saved metrics (summary.json, <variant>/seed<k>/metrics.jsonl, result.json) and final checkpoints; no training."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .._environment import hardware, versions
from .._files import atomic_write_json
from .._numbers import mean_std as _mean_std
from ..text.read import json_lines
from ..variants import REFERENCE as BASELINE
from ..variants import REGISTRY, control_pairs
from . import gradstats
from .claims import MIN_SEEDS, SPREAD_FACTOR
from .report_template import Figure, Heading, Para, Table, to_html, to_markdown

__all__ = ["write_report", "load_run"]
BEFORE = "pretrained (before)"  # the attention records of the model a retrofit started from
# Roles, control pairs (each variant's `controls`, used when both are in the run), what each control isolates and
# the logged statistics come from the variant registry; a run may hold names no longer registered (read as baselines).


# ---------------------------------------------------------------------------------------------------------------
# reading a run
# ---------------------------------------------------------------------------------------------------------------
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

    def series(self, key: str, kind: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of a scalar key; list-valued keys (per layer) are averaged."""
        recs = self.train if kind == "train" else self.evals
        pts = [(r["step"], _scalar(r[key])) for r in recs if key in r and _scalar(r[key]) is not None]
        return np.array([p[0] for p in pts], dtype=float), np.array([p[1] for p in pts], dtype=float)


def _scalar(v) -> float | None:
    if isinstance(v, list):
        flat = [x for x in np.ravel(np.array(v, dtype=float)) if math.isfinite(x)]
        return float(np.mean(flat)) if flat else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _read_metrics(run: SeedRun) -> None:
    for _, rec in json_lines(run.path / "metrics.jsonl"):
        kind = rec.get("kind", "train")
        if kind == "config":
            run.header = rec
        elif kind == "eval":
            run.evals.append(rec)
        elif kind == "train" and "step" in rec:
            run.train.append(rec)


def load_run(run_dir: str | Path) -> tuple[dict, dict[str, list[SeedRun]]]:
    """(summary.json as a dict ({} if absent), variant -> its seed runs in seed order), variants in run order."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    order = list(summary.get("variants", {})) or list(summary.get("config", {}).get("compare", {}).get("variants", []))
    found = sorted(p.parent.parent.name for p in run_dir.glob("*/seed*/metrics.jsonl"))
    order += [v for v in dict.fromkeys(found) if v not in order]
    runs: dict[str, list[SeedRun]] = {}
    for variant in order:
        seeds = sorted((int(p.name[4:]), p) for p in (run_dir / variant).glob("seed*")
                       if p.name[4:].isdigit() and (p / "metrics.jsonl").is_file())
        for seed, path in seeds:
            run = SeedRun(variant, seed, path)
            _read_metrics(run)
            if (path / "result.json").is_file():
                run.result = json.loads((path / "result.json").read_text())
            runs.setdefault(variant, []).append(run)
    if not runs:
        raise ValueError(f"{run_dir} holds no <variant>/seed<k>/metrics.jsonl: is it a `compare` run directory?")
    return summary, runs


# ---------------------------------------------------------------------------------------------------------------
# numbers
# ---------------------------------------------------------------------------------------------------------------
def _fmt(values, fmt: str = "{:.4f}") -> str:
    """'mean ± sample std' over seeds ('mean' alone with one value, '-' with none); a '+' in fmt signs the mean."""
    m, s, _ = _mean_std(values)
    if m is None:
        return "-"
    return fmt.format(m) + (f" ± {fmt.replace('+', '').format(s)}" if s is not None else "")


def _role(name: str) -> str:
    return REGISTRY[name].role if name in REGISTRY else "baseline"


def _is_control(name: str) -> bool:
    return _role(name) == "control"


def _final_train_loss(r: SeedRun) -> float | None:
    if r.result.get("final_train_loss") is not None:
        return r.result["final_train_loss"]
    losses = [t["loss"] for t in r.train if "loss" in t]
    w = max(1, round(0.05 * len(losses)))
    return statistics.fmean(losses[-w:]) if losses else None


def _heldout(r: SeedRun, key: str) -> float | None:
    if r.result.get(key) is not None:
        return r.result[key]
    evals = [e[key] for e in r.evals if key in e]
    return evals[-1] if evals else None


def _zero_shot(summary_entry: dict, seed_runs: list[SeedRun]) -> dict[str, list[float]]:
    """task -> per-seed accuracies (%), from result.json "zero_shot" {task: acc} or summary.json."""
    out: dict[str, list[float]] = {}
    for r in seed_runs:
        for task, acc in (r.result.get("zero_shot") or {}).items():
            if _scalar(acc) is not None:
                out.setdefault(task, []).append(_scalar(acc))
    if not out:
        for task, v in (summary_entry.get("zero_shot") or {}).items():
            vals = v.get("values") if isinstance(v, dict) else [v]
            out[task] = [x for x in (vals or [v.get("mean")]) if x is not None]
    return out


def _grad_window(runs: dict[str, list[SeedRun]], window: int) -> tuple[tuple[int, int], str]:
    last = max((int(r.train[-1]["step"]) for rs in runs.values() for r in rs if r.train), default=0)
    first = min((int(r.train[0]["step"]) for rs in runs.values() for r in rs if r.train), default=0)
    if last < window:
        return (0, last + 1), f"all {last - first + 1} logged steps ({first}-{last}; the run is shorter than {window})"
    return (0, window + 1), f"steps {first}-{window}"


# ---------------------------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------------------------
def _mean_curve(rs: list[SeedRun], key: str, kind: str = "train"):
    """(steps, mean over seeds) on the steps every seed logged; None if no seed has the key."""
    series = [r.series(key, kind) for r in rs]
    series = [s for s in series if s[0].size]
    if not series:
        return None
    common = sorted(set.intersection(*(set(s.tolist()) for s, _ in series)))
    if not common:
        return None
    vals = [np.array([dict(zip(s.tolist(), v.tolist()))[c] for c in common]) for s, v in series]
    return np.array(common), np.mean(vals, axis=0)


def _source(src: dict) -> str:
    kind = src.get("kind", "?")
    if kind == "corpus":
        return f"packaged corpus, {src.get('split', '?')} split"
    if kind == "files":
        return "files " + ", ".join(src.get("paths", []))
    return f"{kind} {src.get('name', '')} {src.get('subset', '')} ({src.get('split', '')})".replace("  ", " ")


def _setup_rows(summary: dict, runs: dict[str, list[SeedRun]]) -> list[list[str]]:
    any_run = next(iter(runs.values()))[0]
    cfg = summary.get("config") or any_run.header.get("config") or {}
    m, d, t, o, s, kd = (cfg.get(k, {}) for k in ("model", "data", "train", "optim", "schedule", "kd"))
    steps = any_run.result.get("steps") or (any_run.train[-1]["step"] if any_run.train else "?")
    seq, gb = d.get("seq_len"), t.get("global_batch")
    tokens = steps * seq * gb if all(isinstance(x, int) for x in (steps, seq, gb)) else None
    base = (runs.get(BASELINE) or [any_run])[0]
    params = base.result.get("params") or base.header.get("params")
    src = d.get("train", {})
    rows = [
        ["model", f"{m.get('arch', '?')}: {m.get('num_layers', '?')} layers, hidden {m.get('hidden_size', '?')}, "
                  f"{m.get('num_heads', '?')} heads / {m.get('num_kv_heads', '?')} KV heads, vocab "
                  f"{m.get('vocab_size', '?')}" + (f", {params:,} parameters ({base.variant})" if params else "")],
        ["data", f"train: {_source(src)}; held-out: {_source(d.get('eval', {}))}; tokenizer "
                 f"{d.get('tokenizer', '?')}, sequence length {seq}"],
        ["training", f"{steps} steps x {gb} sequences" + (f" = {tokens:,} tokens per run" if tokens else "")
                     + f"; AdamW lr {o.get('lr', '?')}, weight decay {o.get('weight_decay', '?')}, "
                       f"{s.get('kind', '?')} schedule, {s.get('warmup_steps', '?')} warm-up steps"],
        ["objective", f"knowledge distillation from {kd.get('teacher')} (T = {kd.get('temperature')}, "
                      f"kd_alpha = {kd.get('kd_alpha')})" if kd.get("enabled") else "next-token cross-entropy"],
        ["variants and seeds", ", ".join(f"{v} ({len(rs)} seed{'s' if len(rs) > 1 else ''})"
                                         for v, rs in runs.items())],
        ["hardware", summary.get("hardware") or f"not recorded in the run; report written on: {hardware()}"],
        ["versions", ", ".join(f"{k} {v}" for k, v in (summary.get("versions") or versions()).items())],
    ]
    if summary.get("total_wall_time_s"):
        rows.append(["total wall time", f"{summary['total_wall_time_s'] / 60:.1f} min"])
    return rows


def _table1(summary: dict, runs: dict[str, list[SeedRun]]) -> tuple[Table, dict]:
    sv = summary.get("variants", {})
    zs = {v: _zero_shot(sv.get(v, {}), rs) for v, rs in runs.items()}
    tasks = list(dict.fromkeys(t for z in zs.values() for t in z))
    header = ["variant", "role", "Δparams", "final train loss", "held-out loss", "held-out ppl"] + tasks
    base_params = runs[BASELINE][0].result.get("params") if BASELINE in runs else None
    rows, numbers = [], {}
    for v, rs in runs.items():
        over = sv.get(v, {}).get("param_overhead")
        if over is None and base_params is not None and rs[0].result.get("params") is not None:
            over = rs[0].result["params"] - base_params
        ftl = [_final_train_loss(r) for r in rs]
        hl = [_heldout(r, "heldout_loss") for r in rs]
        ppl = [_heldout(r, "heldout_ppl") if _heldout(r, "heldout_ppl") is not None
               else (math.exp(h) if h is not None else None) for r, h in zip(rs, hl)]
        numbers[v] = {"final_train_loss": dict(zip([r.seed for r in rs], ftl)),
                      "heldout_loss": dict(zip([r.seed for r in rs], hl))}
        row = [v, _role(v),
               "-" if over is None else f"{over:,}", _fmt(ftl), _fmt(hl), _fmt(ppl, "{:.2f}")]
        row += [_fmt(zs[v].get(t, []), "{:.1f}") for t in tasks]
        rows.append(row)
    n = sorted({len(rs) for rs in runs.values()})
    cap = (f"Mean ± sample std over {'/'.join(map(str, n))} seed(s) (no ± with one seed). Final train loss: mean over "
           "the last 5% of steps. Held-out loss: mean next-token cross-entropy at the last evaluation; "
           f"perplexity = exp(loss). Δparams: extra parameters against {BASELINE}.")
    if tasks:
        cap += " Zero-shot accuracy in %."
    return Table(header, rows, cap, "Table 1. Loss, perplexity" + (" and zero-shot accuracy" if tasks else "")), \
        numbers


def _grad_table(runs: dict[str, list[SeedRun]], window: tuple[int, int], label: str) -> tuple[Table, dict]:
    header = ["variant", "mean", "std", "variance", "CV", "spikes k=6", "spikes k=9"]
    rows, stats = [], {}
    for v, rs in runs.items():
        per = [gradstats.stats_from_file(r.path / "metrics.jsonl", window=window) for r in rs
               if any("grad_norm" in t for t in r.train)]
        stats[v] = per
        if not per:
            rows.append([v] + ["-"] * 6)
            continue
        rows.append([v, _fmt([p["mean"] for p in per], "{:#.3g}"), _fmt([p["std"] for p in per], "{:#.3g}"),
                     _fmt([p["variance"] for p in per], "{:#.3g}"), _fmt([p["cv"] for p in per], "{:.3f}"),
                     _fmt([p["spikes"][6] for p in per], "{:.1f}"), _fmt([p["spikes"][9] for p in per], "{:.1f}")])
    cap = (f"Pre-clip global gradient norm over {label}, mean ± sample std over seeds of each seed's statistic. "
           "Variance and std are population moments over the steps; CV = std / mean; a spike is a step whose norm "
           "exceeds median + k x MAD (raw median absolute deviation) of the same window.")
    return Table(header, rows, cap, "Table 2. Gradient-norm statistics (paper Tables 4-5)"), stats


def _control_table(numbers: dict) -> Table | None:
    rows, isolates = [], {}
    for v, c in control_pairs(numbers):
        held, train = _paired(numbers, v, c, "heldout_loss"), _paired(numbers, v, c, "final_train_loss")
        rows.append([f"{v} − {c}", str(len(held)), _fmt(held, "{:+.4f}"), _fmt(train, "{:+.4f}"), _verdict(held)])
        isolates[c] = REGISTRY[c].isolates
    if not rows:
        return None
    reading = "; ".join(f"method − {c} isolates {what}" for c, what in isolates.items() if what)
    return Table(["method − control", "paired seeds", "Δ held-out loss", "Δ final train loss", "reading"], rows,
                 "Differences paired by seed (same initial weights and data order), mean ± sample std over seeds; "
                 f"negative = the method has the lower loss. Reading: a direction only when |mean| > "
                 f"{SPREAD_FACTOR:g} x the paired std "
                 "(a rough screen, not a significance test)." + (f" {reading[0].upper()}{reading[1:]}." if reading else ""),
                 "Table 3. Methods against their controls")


def _paired(numbers: dict, a: str, b: str, key: str) -> list[float]:
    """a − b per seed, over the seeds where both have a value."""
    x, y = numbers[a][key], numbers[b][key]
    return [x[s] - y[s] for s in x if s in y and x[s] is not None and y[s] is not None]


def _verdict(diffs: list[float], subject: str = "method") -> str:
    """A rough screen, not a significance test: a direction only when |mean| > SPREAD_FACTOR x the paired sample
    std (the Claims table's rule, claims.py)."""
    m, s, n = _mean_std(diffs)
    if m is None:
        return "-"
    if n < MIN_SEEDS:
        return "one seed: no spread estimate"
    if abs(m) > SPREAD_FACTOR * s:
        return f"{subject} {'lower' if m < 0 else 'higher'}".strip()
    return "within seed spread"


def _honest(summary: dict, runs: dict, numbers: dict, grad: dict, window_label: str, attn: dict) -> list[str]:
    """Plain-language reading of the numbers, stating what the run can and cannot show."""
    any_run = next(iter(runs.values()))[0]
    base = (runs.get(BASELINE) or [any_run])[0]
    params = base.result.get("params") or base.header.get("params") or 0
    steps = any_run.result.get("steps") or (any_run.train[-1]["step"] if any_run.train else 0)
    n_seeds = min(len(rs) for rs in runs.values())
    out = [f"Scale: {params / 1e6:.2f}M parameters, {steps} steps, {n_seeds} seed(s) per variant - orders of "
           "magnitude below the paper's 0.5B-3B students trained on 20B tokens. This run checks that every variant "
           "trains and that the diagnostics work; it cannot confirm or refute the paper's claims at scale."]
    hl = {v: _mean_std(list(nums["heldout_loss"].values())) for v, nums in numbers.items()}
    hl = {v: x for v, x in hl.items() if x[0] is not None}
    if hl:
        best = min(hl, key=lambda v: hl[v][0])
        spread = [x[1] for x in hl.values() if x[1] is not None]
        gap = max(x[0] for x in hl.values()) - min(x[0] for x in hl.values())
        text = (f"Held-out loss: lowest for {best} ({hl[best][0]:.4f}); the means of all variants span "
                f"{gap:.4f}.")
        if spread:
            text += (f" The largest seed-to-seed std is {max(spread):.4f}, so unpaired differences below about "
                     f"{2 * max(spread):.4f} are not distinguishable from noise here.")
        else:
            text += " With one seed per variant there is no estimate of run-to-run noise, so no ranking is reliable."
        if BASELINE in numbers:
            parts = [f"{v} {_fmt(d, '{:+.4f}')} ({_verdict(d, '')})" for v in numbers if v != BASELINE
                     if (d := _paired(numbers, v, BASELINE, "heldout_loss"))]
            if parts:
                text += f" Paired by seed against {BASELINE} (variant − {BASELINE}): " + "; ".join(parts) + "."
        out.append(text)
    if BASELINE in grad and grad[BASELINE]:
        cv0 = _mean_std([p["cv"] for p in grad[BASELINE]])[0]
        parts = []
        for v, per in grad.items():
            if v != BASELINE and per:
                cv = _mean_std([p["cv"] for p in per])[0]
                parts.append(f"{v} {cv:.3f} ({cv - cv0:+.3f})")
        if parts:
            out.append(f"Gradient-norm CV, mean over seeds, with the difference to {BASELINE}: {BASELINE} {cv0:.3f}; " +
                       ", ".join(parts) + f"; window: {window_label}. The paper reports a lower CV for affine "
                       "(2.02 vs 2.19 at 1B); a short run at this scale gives a noisy estimate, so read these as a "
                       "check, not a replication.")
    if attn:
        ftm = {v: float(np.nanmean([r.layer_mean("first_token_mass") for r in recs])) for v, recs in attn.items()}
        ent = {v: float(np.nanmean([r.layer_mean("entropy") for r in recs])) for v, recs in attn.items()}
        out.append("Attention of the final checkpoints (mean over layers): first-token mass " +
                   ", ".join(f"{v} {x:.3f}" for v, x in ftm.items()) + "; entropy " +
                   ", ".join(f"{v} {x:.2f}" for v, x in ent.items()) + " nats. These come from one seed and a "
                   "few held-out sequences; small models trained briefly need not develop the attention sink the "
                   "paper's analysis starts from.")
    return out


def _attention_records(runs: dict[str, list[SeedRun]], cfg: dict, sequences: int, length: int, chunk: int):
    """variant -> seed -> LayerRecords of that run's final checkpoint on the first held-out windows, plus the
    pretrained model a retrofit started from (key BEFORE); (records, note)."""
    from .analyze import load_model, record, token_windows

    texts, note = _heldout_texts(cfg)
    out: dict = {}

    def rec(spec: str):
        model, tok, _ = load_model(spec)
        return record(model, token_windows(tok, texts, sequences, length), chunk=chunk)

    init_from = cfg.get("model", {}).get("init_from")
    if init_from:
        out[BEFORE] = {0: rec(init_from)}
    for v, rs in runs.items():
        for r in rs:
            if (r.final / "config.json").is_file():
                out.setdefault(v, {})[r.seed] = rec(str(r.final))
    return out, f"{sequences} windows of {length} tokens from {note}"


def _claims(summary: dict, runs: dict[str, list[SeedRun]], numbers: dict, gwin: tuple[int, int], by_seed: dict,
            length: int) -> dict:
    """The Claims table's data (see claims.py): for each method, rows against the baseline and its first control
    in the run; plus the rule and whether the baseline formed an attention sink."""
    from . import claims

    grad = {v: {r.seed: gradstats.stats_from_file(r.path / "metrics.jsonl", window=gwin) for r in rs
                if any("grad_norm" in t for t in r.train)} for v, rs in runs.items()}
    att = {v: {s: claims.attention_scalars(recs, _output_scale(runs, v, s)) for s, recs in per.items()}
           for v, per in by_seed.items() if v != BEFORE}
    zs = {v: {r.seed: {t: _scalar(a) for t, a in (r.result.get("zero_shot") or {}).items() if _scalar(a) is not None}
              for r in rs} for v, rs in runs.items()}
    per_seed = claims.run_per_seed(numbers, grad, att, zs)
    sink = claims.baseline_sink(att.get(BASELINE, {}), length)
    out = {"rule": claims.RULE_TEXT, "baseline": BASELINE, "baseline_sink": sink, "methods": {}}
    for v in runs:
        if REGISTRY.get(v) is None or REGISTRY[v].role != "method":
            continue
        ctrl = next((c for c in REGISTRY[v].controls if c in runs), None)
        out["methods"][v] = {"control": ctrl, "rows": claims.claim_rows(per_seed, method=v, baseline=BASELINE,
                                                                        control=ctrl, baseline_sink=sink)}
    return out


def _output_scale(runs: dict[str, list[SeedRun]], variant: str, seed: int) -> float:
    """1 / the factor a function-preserving conversion started this run's attention weights at (1 when the run
    was not a retrofit, or its variant does not scale its weights)."""
    for r in runs.get(variant, []):
        if r.seed == seed and (r.final / "config.json").is_file():
            spec = json.loads((r.final / "config.json").read_text()).get("affine_attention") or {}
            return 1.0 / float((spec.get("retrofit") or {}).get("weight_scale", 1.0))
    return 1.0


def claims_blocks(claims: dict) -> list:
    """The report's Claims section: one table per method (affine first)."""
    if not claims["methods"]:
        return []

    def cell(side: dict) -> str:
        d = side["diff"]
        if d["n"] == 0:
            return "-"
        spread = f" ± {d['std']:.3g}" if d["std"] is not None else ""
        return f"{d['mean']:+.3g}{spread} (n={d['n']})"

    def verdict(side: dict) -> str:
        return side["verdict"] + (f" ({side['why']})" if side.get("why") else "")

    out = [Heading("Claims")]
    for method, m in claims["methods"].items():
        ctrl = m["control"] or "control"
        rows = [[r["text"], r["metric"], cell(r["baseline"]), verdict(r["baseline"]), cell(r["control"]),
                 verdict(r["control"])] for r in m["rows"]]
        out.append(Table(["paper's claim", "measured as", f"{method} − {BASELINE}", "verdict",
                          f"{method} − {ctrl}", "verdict"], rows, claims["rule"],
                         f"The paper's claims for {method}, against {BASELINE} and against {ctrl}"))
    return out


def _record_claims(run_dir: Path, summary: dict, claims: dict) -> None:
    """The Claims table, machine-readable, in summary.json (rewritten atomically) when the run has one."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return
    atomic_write_json(path, {**summary, "claims": claims})


def _heldout_texts(cfg: dict) -> tuple[list[str], str]:
    from ..text import documents

    src = cfg.get("data", {}).get("eval", {})
    if src.get("kind") == "files" and src.get("paths"):
        return list(documents("files", paths=src["paths"], text_field=src.get("text_field", "text"))), \
            "the run's held-out files"
    split = src.get("split", "validation") if src.get("kind", "corpus") == "corpus" else "validation"
    return list(documents("corpus", split=split)), f"the packaged corpus ({split} split)"


ATTENTION_CAPTIONS = {
    "first_token_mass": "Mean attention weight on the first token per layer (paper Fig. 4).",
    "entropy": "Mean attention entropy per layer, in nats (paper Fig. 6).",
    "head_mass": "Layer x head total attention mass on non-first tokens, min-max normalised per model (paper "
                 "Fig. 5); for the sink the sink's share is excluded.",
    "mass_histogram": "Per-query total attention mass on non-first tokens, all layers and heads (paper Fig. 3).",
    "attention_map": "Head-averaged attention weights of the middle layer, first 30 tokens (paper Fig. 7); a "
                     "diverging scale when some weight is negative (affine).",
    "alpha_histogram": "Distribution of α over tokens, layers and heads (paper Fig. 8); a frozen (constant) α is "
                       "left out.",
}


def _training_figures(runs: dict[str, list[SeedRun]], figdir: Path, kd: bool, gwin: tuple[int, int],
                      glabel: str) -> list[Figure]:
    """Loss, held-out loss, gradient norm, QK logit and alpha curves from the metrics logs."""
    from . import plots

    figs: list[Figure] = []
    steps_max = max((len(r.train) for rs in runs.values() for r in rs), default=1)
    smooth = max(1, steps_max // 60)
    loss = {v: c for v, rs in runs.items() if (c := _mean_curve(rs, "loss")) is not None}
    if loss:
        figs.append(Figure(plots.plot_loss_curves(loss, figdir / "loss.png", smooth=smooth,
                                                  title="Training loss" + (" (KD objective)" if kd else "")),
                           "Training loss, mean over seeds" +
                           (f" (moving average over {smooth} steps)" if smooth > 1 else "") +
                           "; right: the last 30% of steps, where the variants separate, if at all."))
    held = {v: c for v, rs in runs.items() if (c := _mean_curve(rs, "heldout_loss", "eval")) is not None
            and c[0].size > 1}
    if held:
        # Evaluations are sparse: zoom on the last three of them, so every zoomed line has its end points.
        ev = sorted({float(x) for steps, _ in held.values() for x in steps})
        frac = min(1.0, (ev[-1] - ev[max(0, len(ev) - 3)]) / (ev[-1] - ev[0]) if ev[-1] > ev[0] else 1.0) or 1.0
        figs.append(Figure(plots.plot_loss_curves(held, figdir / "heldout_loss.png", zoom_last_frac=frac,
                                                  title="Held-out loss", ylabel="held-out loss"),
                           "Held-out next-token loss at each evaluation, mean over seeds; right: the last three "
                           "evaluations."))
    gn = {v: rs[0].series("grad_norm") for v, rs in runs.items() if rs[0].series("grad_norm")[0].size}
    if gn:
        figs.append(Figure(plots.plot_grad_norms(gn, figdir / "grad_norm.png", window=(gwin[0], gwin[1] - 1)),
                           f"Pre-clip gradient norm of the first seed (not averaged: averaging hides spikes); "
                           f"right: {glabel}, the window of Table 2."))
    qk = {v: c for v, rs in runs.items() if (c := _mean_curve(rs, "qk_logit_mean", "eval")) is not None}
    if qk:
        figs.append(Figure(plots.plot_qk_logit(qk, figdir / "qk_logit.png"),
                           "Mean query-key logit (q·k × scale over visible keys, all layers and heads) on a fixed "
                           "probe batch during training, mean over seeds (paper Fig. 2)."))
    for key, label in _token_stats(runs).items():
        curves = {v: c for v, rs in runs.items() if (c := _mean_curve(rs, f"{key}_mean")) is not None}
        if curves:
            figs.append(Figure(plots.plot_qk_logit(curves, figdir / f"{key}_training.png", ylabel=f"mean {label}",
                                                   title=f"Mean {label} during training", smooth=smooth),
                               f"Mean {label} over layers, heads and tokens of each step's batch, mean over seeds."))
    return figs


def _token_stats(runs: dict[str, list[SeedRun]]) -> dict[str, str]:
    """key -> label of the per-token statistics the run's variants declare (variant.token_stats), in run order."""
    out: dict[str, str] = {}
    for v in runs:
        if v in REGISTRY:
            for key, label in REGISTRY[v].token_stats.items():
                out.setdefault(key, label)
    return out


def write_report(run_dir: str | Path, *, sequences: int = 4, length: int | None = None, attention: bool = True,
                 window: tuple[int, int] | int = 500, chunk: int = 256) -> dict[str, Path]:
    """Write run_dir/report.md, run_dir/report.html (self-contained) and run_dir/figures/*.png; return their paths.

    sequences, length: held-out windows for the attention diagnostics of every final checkpoint (figures: the first
    seed; the Claims table: every seed; length defaults to the run's seq_len); attention=False skips them. window: gradient statistics over the first
    `window` steps (an int, or a (0, end) pair as accepted by the CLI), or the whole run when it is shorter.
    """
    run_dir = Path(run_dir)
    summary, runs = load_run(run_dir)
    cfg = summary.get("config") or next(iter(runs.values()))[0].header.get("config") or {}
    figdir = run_dir / "figures"
    gwin, glabel = _grad_window(runs, window if isinstance(window, int) else int(window[1]))
    t1, numbers = _table1(summary, runs)
    t2, grad = _grad_table(runs, gwin, glabel)
    t3 = _control_table(numbers)
    figs = _training_figures(runs, figdir, bool(cfg.get("kd", {}).get("enabled")), gwin, glabel)
    attn: dict = {}
    by_seed: dict = {}
    length = length or cfg.get("data", {}).get("seq_len") or 128
    if attention:
        from .analyze import write_figures

        by_seed, note = _attention_records(runs, cfg, sequences, length, chunk)
        attn = {v: recs[min(recs)] for v, recs in by_seed.items()}  # figures: each variant's first seed
        if attn:
            figs += [Figure(path, f"{ATTENTION_CAPTIONS[key]} Final checkpoints (first seed), {note}.")
                     for key, path in write_figures(attn, figdir).items()]
        missing = [v for v in runs if v not in attn]
        if missing:
            figs.append(Para(f"No attention diagnostics for {', '.join(missing)}: no final checkpoint."))
    blocks: list = [Heading(f"Affine-Scaled Attention comparison: {run_dir.name}", 1), Heading("Set-up"),
                    Table(["item", "value"], _setup_rows(summary, runs), key_value=True), Heading("Results"), t1, t2]
    controls = [v for v in runs if _is_control(v)]
    if controls:
        what = "; ".join(f"{c}: {REGISTRY[c].isolates}" for c in controls if REGISTRY[c].isolates)
        blocks.append(Para(f"Controls in this run: {', '.join(controls)}. They are not methods; they separate a "
                           "method's gain from something simpler" + (f" ({what})." if what else ".")))
    if t3 is not None:
        blocks.append(t3)
    claims = _claims(summary, runs, numbers, gwin, by_seed, length)
    blocks += claims_blocks(claims)
    _record_claims(run_dir, summary, claims)
    blocks += [Heading("What this run shows and does not show")]
    blocks += [Para(p) for p in _honest(summary, runs, numbers, grad, glabel, attn)]
    blocks += [Heading("Figures")] + figs
    md = run_dir / "report.md"
    md.write_text(to_markdown(blocks, run_dir))
    html_path = run_dir / "report.html"
    html_path.write_text(to_html(blocks, f"affine-attention report: {run_dir.name}"))
    return {"md": md, "html": html_path, "figures": figdir}
