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

# The rule. A paired difference d (method - reference, one per seed) is read, in this order, as:
#   "not testable here"  fewer than MIN_SEEDS paired seeds, a metric this run did not measure, or a claim the run's
#                        set-up cannot test (first-token claims: a baseline, variants.REFERENCE, that forms no
#                        attention sink; head utilisation: one head per layer)
#   "within seed spread" |mean| <= SPREAD_FACTOR x sample std of d (including a mean of exactly zero)
#   "negligible"         |mean| below the metric's minimum effect (MIN_EFFECT): beyond the spread, too small to count
#   "holds"              otherwise, the mean in the claimed direction
#   "does not hold"      otherwise, the mean against it
# (SPREAD_FACTOR and MIN_SEEDS live in _numbers.spread_direction.) The report's Table 3 and prose read this rule too.
# "The baseline forms an attention sink": its first-token mass, in at least SINK_MIN_LAYERS layers (every
# layer if the model has fewer), is at least SINK_FACTOR times the uniform share (the mean of 1 / N_i over queries).
SINK_FACTOR = 3.0
SINK_MIN_LAYERS = 2


@dataclass(frozen=True)
class MinEffect:
    """The smallest paired mean difference that counts: `size` x |the baseline's mean| (relative) or `size` in the
    metric's units (absolute). `why` is its justification (docs/studies.md, "How the Claims table decides")."""
    size: float
    relative: bool
    why: str

    def of(self, baseline_mean: float | None) -> float | None:
        """The threshold in the metric's units; None when a relative one has no baseline value to scale."""
        if not self.relative:
            return self.size
        return None if baseline_mean is None else self.size * abs(baseline_mean)

    def words(self, baseline: str = "the baseline") -> str:
        return f"{self.size:.1%} of {baseline}'s value" if self.relative else f"{self.size:g}"


# About half the smallest gain the paper reports for the metric where it reports one (PAPER.md, 1B unless said), so
# a paper-sized effect counts; 10% of the baseline's value for the attention metrics the paper shows only as figures.
MIN_EFFECT = {
    "final_train_loss": MinEffect(0.002, True, "the paper's loss gain is 0.37%: 2.73 -> 2.72 at 1B"),
    "heldout_loss": MinEffect(0.002, True, "the paper's smallest perplexity gain, 71.7 -> 70.6 at 0.5B, is 0.36% "
                              "of the log-perplexity"),
    "grad_cv": MinEffect(0.04, True, "the paper's CV gain is 7.8%: 2.19 -> 2.02 at 1B"),
    "spikes_k9": MinEffect(0.5, False, "spikes; the paper's gain is one spike: 28 -> 27 at 1B"),
    "first_token_mass": MinEffect(0.1, True, "the paper shows it as a figure only"),
    "dormant_first_token_mass": MinEffect(0.1, True, "the paper shows it as a figure only"),
    "entropy": MinEffect(0.1, True, "the paper shows it as a figure only"),
    "head_mass_cv": MinEffect(0.1, True, "the paper shows it as a figure only"),
    "zero_shot_avg": MinEffect(0.25, False, "accuracy points; the paper's smallest average gain is 0.5 (1B)"),
}


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
VERDICT_MARKS = {"holds": "✓", "does not hold": "✗", "within seed spread": "≈", "negligible": "○",
                 "not testable here": "–"}


def marked(verdict_text: str) -> str:
    """The verdict with its mark, e.g. '✓ holds'."""
    mark = VERDICT_MARKS.get(verdict_text)
    return f"{mark} {verdict_text}" if mark else verdict_text


def verdict(diffs: list[float], direction: int, min_effect: float | None) -> str:
    """The rule above, for paired differences (method - reference), the claimed direction (-1 lower, +1 higher) and
    the metric's minimum effect in its units (None: no baseline value to scale it by, so the claim is not
    testable)."""
    seen = spread_direction(diffs)
    if seen is None or min_effect is None:
        return "not testable here"
    if seen == 0:
        return "within seed spread"
    if abs(mean_std(diffs)[0]) < min_effect:
        return "negligible"
    return "holds" if seen == direction else "does not hold"


def sink_formed(first_token_by_layer: list[float], uniform_share: float) -> bool:
    """Whether a model's per-layer first-token mass shows an attention sink (see SINK_FACTOR, SINK_MIN_LAYERS)."""
    if not first_token_by_layer or not uniform_share > 0:
        return False
    need = min(SINK_MIN_LAYERS, len(first_token_by_layer))
    return sum(m >= SINK_FACTOR * uniform_share for m in first_token_by_layer) >= need


def _summary(diffs: list[float]) -> dict:
    mean, std, n = mean_std(diffs)
    return {"mean": mean, "std": std, "n": n}


def baseline_mean(per_seed: dict, baseline: str, metric: str) -> float | None:
    """The baseline's mean of metric over its seeds (the scale of a relative minimum effect); None if unmeasured."""
    return mean_std([vals.get(metric) for vals in per_seed.get(baseline, {}).values()])[0]


def claim_rows(per_seed: dict, *, method: str, baseline: str, control: str | None,
               baseline_sink: bool | None, sink_criterion: str | None = None,
               untestable: dict[str, str] | None = None) -> list[dict]:
    """One row per claim: the paired differences of `method` to `baseline` and to `control`, the metric's minimum
    effect (MIN_EFFECT, scaled by the baseline's mean) and the verdicts.

    baseline_sink: whether the baseline formed an attention sink (None: not measured). Rows whose metric no run
    measured (e.g. zero-shot without tasks) are left out; a metric measured for some runs only is "not testable
    here" where the pairs are missing. sink_criterion: the sink test in words when it is not SINK_FACTOR x the
    uniform share in SINK_MIN_LAYERS layers (the reason a first-token row gives when the baseline fails it).
    untestable: claim key -> why this run's set-up cannot test it (e.g. head utilisation with one head per layer).
    A side's "why" says what a reader needs beside the verdict: why not testable, or the minimum effect a
    negligible difference falls below.
    """
    rows = []
    measured = {m for runs in per_seed.values() for vals in runs.values() for m, v in vals.items() if v is not None}
    for c in CLAIMS:
        if c.metric not in measured:
            continue
        rule = MIN_EFFECT[c.metric]
        scale = baseline_mean(per_seed, baseline, c.metric)
        least = rule.of(scale)
        row = {"claim": c.key, "text": c.text, "metric": c.metric,
               "direction": "lower" if c.direction < 0 else "higher", "min_effect": least,
               "min_effect_rule": {"size": rule.size, "relative": rule.relative, "why": rule.why}}
        for ref_name, ref in (("baseline", baseline), ("control", control)):
            if ref is None or ref not in per_seed:
                row[ref_name] = {"against": ref, "diff": _summary([]), "verdict": "not testable here",
                                 "why": "not run" if ref is not None else "no control for this method"}
                continue
            diffs = paired(per_seed, method, ref, c.metric)
            v, why = verdict(diffs, c.direction, least), None
            if c.needs_sink and baseline_sink is not True:
                v = "not testable here"
                why = ("first-token mass of the baseline not measured" if baseline_sink is None else
                       f"{baseline} forms no attention sink ({sink_criterion})" if sink_criterion else
                       f"{baseline} forms no attention sink: fewer than {SINK_MIN_LAYERS} layers reach "
                       f"{SINK_FACTOR:g}x the uniform first-token share")
            elif untestable and c.key in untestable:
                v, why = "not testable here", untestable[c.key]
            elif len(diffs) < MIN_SEEDS:
                why = f"{len(diffs)} paired seed(s); the rule needs {MIN_SEEDS}"
            elif least is None:
                why = f"{baseline} has no {c.metric} to scale the minimum effect by"
            elif v == "negligible":
                why = f"{c.metric}: below the minimum effect {least:.3g}, {rule.words(baseline)} ({rule.why})"
            row[ref_name] = {"against": ref, "diff": _summary(diffs), "verdict": v, "why": why}
        rows.append(row)
    return rows


RULE_TEXT = (f"Differences are method − reference, paired by seed (same initial weights and data order). With at "
             f"least {MIN_SEEDS} paired seeds, a difference whose mean is not beyond {SPREAD_FACTOR:g} x the sample "
             "std of the paired differences is within seed spread; one beyond it but below the metric's minimum "
             "effect (column 'min. effect': about half the paper's own gain, or 10% of the baseline's value for the "
             "attention metrics; docs/studies.md) is negligible; a larger one holds or does not hold by its "
             "direction. Not testable here: fewer seeds, or a set-up that cannot show the claim (the first-token "
             f"claims need a {REFERENCE} baseline that forms an attention sink: first-token mass at least "
             f"{SINK_FACTOR:g}x the uniform share in at least {SINK_MIN_LAYERS} layers; head utilisation needs more "
             "than one head per layer). This is a screen, not a significance test.")


# ---------------------------------------------------------------------------------------------------------------
# per-run scalars from what a compare run records
# ---------------------------------------------------------------------------------------------------------------
def uniform_first_token_share(length: int) -> float:
    """Mean over the queries of a causal window of `length` tokens of 1 / N_i (N_i = i + 1 keys): the first-token
    weight that uniform attention would give."""
    return sum(1.0 / (i + 1) for i in range(length)) / length


def attention_scalars(records, output_scale: float = 1.0) -> dict:
    """LayerRecords of one model -> first_token_mass (mean over layers), entropy (mean over layers), head_mass_cv
    (coefficient of variation of the per-head mean non-first-token mass over every layer's heads), the per-layer
    first-token masses (for the sink test) and the fewest heads in a layer (head utilisation needs more than one).

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
            "head_mass_cv": cv, "first_token_by_layer": first,
            "heads_per_layer": min(r.stats["mean_total_mass"].numel() for r in records)}


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
