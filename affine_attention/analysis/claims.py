"""The paper's claims as rows with verdicts: per-seed numbers in, paired differences and a stated rule out.

Pure functions on plain dicts (no files, no models), so the rule is unit-tested on hand-made summaries and the report
and summary.json carry the same table.

Input layout: per_seed[variant][seed] = {metric: value or None}. Metrics (the per-run scalars):
  final_train_loss, heldout_loss       lower is better (held-out perplexity is exp(heldout_loss): same verdict)
  grad_cv, spikes_k9                   gradient-norm CV and spike count in the early-training window
  first_token_mass                     mean over layers of the first-token attention weight
  dormant_first_token_mass             first-token weight of the queries with nothing to do (Bigram-Backcopy
                                       non-trigger queries) at the probe's layer; only on such runs
  entropy                              mean over layers of the attention entropy (nats)
  head_mass_cv                         coefficient of variation, across every layer's heads, of the mean
                                       non-first-token attention mass: lower = more even head utilisation
  zero_shot_avg                        mean zero-shot accuracy over the tasks run (only when tasks were run)
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from .._numbers import MIN_SEEDS, SPREAD_FACTOR, mean_std, spread_direction
from ..variants import REFERENCE

# The rule. A paired difference d (method - reference, one per seed) is read as:
#   "holds"              n >= 2, mean in the claimed direction and |mean| > SPREAD_FACTOR x sample std of d
#   "does not hold"      n >= 2, mean against the claimed direction and |mean| > SPREAD_FACTOR x sample std of d
#   "within seed spread" otherwise (including a mean of exactly zero)
#   "not testable here"  fewer than 2 paired seeds, a metric this run did not measure, or (first-token claim) a
#                        baseline (variants.REFERENCE) that forms no attention sink
# (SPREAD_FACTOR, MIN_SEEDS and the rule itself live in _numbers.spread_direction: the report's tables read it too.)
# "The baseline forms an attention sink": its first-token mass, in at least SINK_MIN_LAYERS layers (every
# layer if the model has fewer), is at least SINK_FACTOR times the uniform share (the mean of 1 / N_i over queries).
SINK_FACTOR = 3.0
SINK_MIN_LAYERS = 2


@dataclass(frozen=True)
class Claim:
    key: str
    text: str  # the paper's claim, as the report states it
    metric: str
    direction: int  # -1: the method should be lower; +1: higher
    needs_sink: bool = False


CLAIMS = [
    Claim("train_loss", "lower training loss", "final_train_loss", -1),
    Claim("heldout", "lower held-out perplexity", "heldout_loss", -1),
    Claim("grad_cv", "lower gradient-norm CV", "grad_cv", -1),
    Claim("spikes", "fewer gradient spikes (k = 9)", "spikes_k9", -1),
    Claim("first_token", "less first-token attention", "first_token_mass", -1, needs_sink=True),
    # Where a run knows which queries have nothing to do (the Bigram-Backcopy probe): their first-token mass of the
    # effective weights at the probe's layer, the place the sink forms, rather than a mean over every query and layer.
    Claim("first_token_dormant", "less first-token attention where the head is dormant (effective weights)",
          "dormant_first_token_mass", -1, needs_sink=True),
    Claim("entropy", "higher attention entropy", "entropy", +1),
    Claim("heads", "more even head utilisation", "head_mass_cv", -1),
    Claim("zero_shot", "higher zero-shot accuracy", "zero_shot_avg", +1),
]


def paired(per_seed: dict, a: str, b: str, metric: str) -> list[float]:
    """a - b for every seed where both runs have a finite value of metric."""
    xa, xb = per_seed.get(a, {}), per_seed.get(b, {})
    out = []
    for seed in sorted(set(xa) & set(xb)):
        va, vb = xa[seed].get(metric), xb[seed].get(metric)
        if va is not None and vb is not None and math.isfinite(va) and math.isfinite(vb):
            out.append(va - vb)
    return out


# A mark per verdict, so a wide table reads at a glance (report, compare's closing lines).
VERDICT_MARKS = {"holds": "✓", "does not hold": "✗", "within seed spread": "≈", "not testable here": "–"}


def marked(verdict_text: str) -> str:
    """The verdict with its mark, e.g. '✓ holds'."""
    mark = VERDICT_MARKS.get(verdict_text)
    return f"{mark} {verdict_text}" if mark else verdict_text


def verdict(diffs: list[float], direction: int) -> str:
    """The rule above, for paired differences (method - reference) and the claimed direction (-1 lower, +1 higher)."""
    seen = spread_direction(diffs)
    if seen is None:
        return "not testable here"
    return "within seed spread" if seen == 0 else "holds" if seen == direction else "does not hold"


def sink_formed(first_token_by_layer: list[float], uniform_share: float) -> bool:
    """Whether a model's per-layer first-token mass shows an attention sink (see SINK_FACTOR, SINK_MIN_LAYERS)."""
    if not first_token_by_layer or not uniform_share > 0:
        return False
    need = min(SINK_MIN_LAYERS, len(first_token_by_layer))
    return sum(m >= SINK_FACTOR * uniform_share for m in first_token_by_layer) >= need


def _summary(diffs: list[float]) -> dict:
    mean, std, n = mean_std(diffs)
    return {"mean": mean, "std": std, "n": n}


def claim_rows(per_seed: dict, *, method: str, baseline: str, control: str | None,
               baseline_sink: bool | None, sink_criterion: str | None = None) -> list[dict]:
    """One row per claim: the paired differences of `method` to `baseline` and to `control`, and their verdicts.

    baseline_sink: whether the baseline formed an attention sink (None: not measured). Rows whose metric no run
    measured (e.g. zero-shot without tasks) are left out; a metric measured for some runs only is "not testable
    here" where the pairs are missing. sink_criterion: the sink test in words when it is not SINK_FACTOR x the
    uniform share in SINK_MIN_LAYERS layers (the reason a first-token row gives when the baseline fails it).
    """
    rows = []
    measured = {m for runs in per_seed.values() for vals in runs.values() for m, v in vals.items() if v is not None}
    for c in CLAIMS:
        if c.metric not in measured:
            continue
        row = {"claim": c.key, "text": c.text, "metric": c.metric,
               "direction": "lower" if c.direction < 0 else "higher"}
        for ref_name, ref in (("baseline", baseline), ("control", control)):
            if ref is None or ref not in per_seed:
                row[ref_name] = {"against": ref, "diff": _summary([]), "verdict": "not testable here",
                                 "why": "not run" if ref is not None else "no control for this method"}
                continue
            diffs = paired(per_seed, method, ref, c.metric)
            v, why = verdict(diffs, c.direction), None
            if c.needs_sink and baseline_sink is not True:
                v = "not testable here"
                why = ("first-token mass of the baseline not measured" if baseline_sink is None else
                       f"{baseline} forms no attention sink ({sink_criterion})" if sink_criterion else
                       f"{baseline} forms no attention sink: fewer than {SINK_MIN_LAYERS} layers reach "
                       f"{SINK_FACTOR:g}x the uniform first-token share")
            elif len(diffs) < MIN_SEEDS:
                why = f"{len(diffs)} paired seed(s); the rule needs {MIN_SEEDS}"
            row[ref_name] = {"against": ref, "diff": _summary(diffs), "verdict": v, "why": why}
        rows.append(row)
    return rows


RULE_TEXT = (f"Differences are method − reference, paired by seed (same initial weights and data order). A claim "
             f"holds when, with at least {MIN_SEEDS} paired seeds, the mean difference points the claimed way and "
             f"exceeds {SPREAD_FACTOR:g} x the sample std of the paired differences; it does not hold when the same is "
             "true the other way; otherwise it is within seed spread. The first-token claim is not testable when the "
             f"{REFERENCE} baseline forms no attention sink: first-token mass at least {SINK_FACTOR:g}x the uniform "
             f"share in at least {SINK_MIN_LAYERS} layers. This is a screen, not a significance test.")


# ---------------------------------------------------------------------------------------------------------------
# per-run scalars from what a compare run records
# ---------------------------------------------------------------------------------------------------------------
def uniform_first_token_share(length: int) -> float:
    """Mean over the queries of a causal window of `length` tokens of 1 / N_i (N_i = i + 1 keys): the first-token
    weight that uniform attention would give."""
    return sum(1.0 / (i + 1) for i in range(length)) / length


def attention_scalars(records, output_scale: float = 1.0) -> dict:
    """LayerRecords of one model -> first_token_mass (mean over layers), entropy (mean over layers), head_mass_cv
    (coefficient of variation of the per-head mean non-first-token mass over every layer's heads) and the per-layer
    first-token masses (for the sink test).

    output_scale: 1 / the factor a function-preserving conversion started the attention weights at (affine: alpha
    = 0.5 times softmax's, o_proj compensating), so the comparison measures what training changed, not the
    conversion. Entropy and the CV do not depend on it."""
    if not records:
        return {}
    first = [output_scale * r.layer_mean("first_token_mass") for r in records]
    heads = torch.cat([r.stats["mean_total_mass"].to(torch.float64).flatten() for r in records])
    heads = heads[torch.isfinite(heads)]
    cv = float(heads.std(unbiased=False) / heads.mean()) if heads.numel() > 1 and float(heads.mean()) > 0 else None
    return {"first_token_mass": statistics.fmean(first),
            "entropy": statistics.fmean(r.layer_mean("entropy") for r in records),
            "head_mass_cv": cv, "first_token_by_layer": first}


def baseline_sink(per_seed_attention: dict, length: int) -> bool | None:
    """Whether the baseline's per-layer first-token mass (mean over seeds) shows a sink; None if not measured."""
    layers = [a["first_token_by_layer"] for a in per_seed_attention.values() if a.get("first_token_by_layer")]
    if not layers:
        return None
    mean = [statistics.fmean(x) for x in zip(*layers)]
    return sink_formed(mean, uniform_first_token_share(length))


def run_per_seed(numbers: dict, grad_by_seed: dict, attention_by_seed: dict, zero_shot_by_seed: dict) -> dict:
    """per_seed[variant][seed] = {metric: value} from what the report reads of a run: numbers[v][metric][seed]
    (losses), grad_by_seed[v][seed] (gradstats of the window), attention_by_seed[v][seed] (attention_scalars),
    zero_shot_by_seed[v][seed] ({task: accuracy %})."""
    out: dict = {}
    for v in set(numbers) | set(grad_by_seed) | set(attention_by_seed):
        seeds = set(numbers.get(v, {}).get("heldout_loss", {})) | set(grad_by_seed.get(v, {})) \
            | set(attention_by_seed.get(v, {}))
        for s in seeds:
            row = {k: numbers.get(v, {}).get(k, {}).get(s) for k in ("final_train_loss", "heldout_loss")}
            g = grad_by_seed.get(v, {}).get(s)
            if g:
                row["grad_cv"], row["spikes_k9"] = g["cv"], float(g["spikes"][9])
            a = attention_by_seed.get(v, {}).get(s) or {}
            row.update({k: a.get(k) for k in ("first_token_mass", "dormant_first_token_mass", "entropy",
                                              "head_mass_cv")})
            z = zero_shot_by_seed.get(v, {}).get(s)
            row["zero_shot_avg"] = statistics.fmean(z.values()) if z else None
            out.setdefault(v, {})[s] = row
    return out
