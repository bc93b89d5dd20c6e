"""The report's plain-language text: its title, the note on the controls a run holds and what the run shows and does
not show; every variant it names is read from the registry (the paper's method, the reference, each control)."""
from __future__ import annotations

import numpy as np

from .._numbers import mean_std
from ..variants import REFERENCE as BASELINE
from ..variants import REGISTRY
from .compare_run import SeedRun, is_control, reference_run, run_steps
from .report_tables import fmt_seeds, loss_verdict, paired

__all__ = ["paper_method", "title", "controls_note", "honest"]


def paper_method() -> str:
    """The paper's proposal: the first registered variant whose role is "method"."""
    return next(name for name, cls in REGISTRY.items() if cls.role == "method")


def title(run_name: str) -> str:
    return f"{REGISTRY[paper_method()].display.label} attention comparison: {run_name}"


def controls_note(runs: dict[str, list[SeedRun]]) -> str | None:
    """Which controls the run holds and what each isolates (None without any)."""
    controls = [v for v in runs if is_control(v)]
    if not controls:
        return None
    what = "; ".join(f"{c}: {REGISTRY[c].isolates}" for c in controls if REGISTRY[c].isolates)
    return (f"Controls in this run: {', '.join(controls)}. They are not methods; they separate a method's gain from "
            "something simpler" + (f" ({what})." if what else "."))


def honest(runs: dict[str, list[SeedRun]], numbers: dict, grad: dict, window_label: str, attn: dict) -> list[str]:
    """Plain-language reading of the numbers, stating what the run can and cannot show.

    numbers: Table 1's per-seed losses; grad: Table 2's per-seed statistics; attn: variant -> LayerRecords of its
    first seed ({} without attention diagnostics)."""
    params = reference_run(runs).params or 0
    steps = run_steps(runs) or 0
    n_seeds = min(len(rs) for rs in runs.values())
    out = [f"Scale: {params / 1e6:.2f}M parameters, {steps} steps, {n_seeds} seed(s) per variant - orders of "
           "magnitude below the paper's 0.5B-3B students trained on 20B tokens. This run checks that every variant "
           "trains and that the diagnostics work; it cannot confirm or refute the paper's claims at scale."]
    hl = {v: mean_std(list(nums["heldout_loss"].values())) for v, nums in numbers.items()}
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
            parts = [f"{v} {fmt_seeds(d, '{:+.4f}')} ({loss_verdict(numbers, v, BASELINE, 'heldout_loss')})"
                     for v in numbers if v != BASELINE if (d := paired(numbers, v, BASELINE, "heldout_loss"))]
            if parts:
                text += (f" Paired by seed against {BASELINE} (variant − {BASELINE}), with the Claims rule's verdict "
                         "on lower held-out loss: " + "; ".join(parts) + ".")
        out.append(text)
    if BASELINE in grad and grad[BASELINE]:
        cv0 = mean_std([p["cv"] for p in grad[BASELINE]])[0]
        parts = []
        for v, per in grad.items():
            if v != BASELINE and per:
                cv = mean_std([p["cv"] for p in per])[0]
                parts.append(f"{v} {cv:.3f} ({cv - cv0:+.3f})")
        if parts:
            out.append(f"Gradient-norm CV, mean over seeds, with the difference to {BASELINE}: {BASELINE} {cv0:.3f}; "
                       + ", ".join(parts) + f"; window: {window_label}. The paper reports a lower CV for "
                       f"{paper_method()} (2.02 vs 2.19 at 1B); a short run at this scale gives a noisy estimate, so "
                       "read these as a check, not a replication.")
    if attn:
        ftm = {v: float(np.nanmean([r.layer_mean("first_token_mass") for r in recs])) for v, recs in attn.items()}
        ent = {v: float(np.nanmean([r.layer_mean("entropy") for r in recs])) for v, recs in attn.items()}
        out.append("Attention of the final checkpoints of the first seed (mean over layers; the figures show the "
                   "same models): first-token mass " + ", ".join(f"{v} {x:.3f}" for v, x in ftm.items()) +
                   "; entropy " + ", ".join(f"{v} {x:.2f}" for v, x in ent.items()) + " nats. The Claims read "
                   f"these metrics on every seed ({n_seeds} per variant here), paired; small models trained briefly "
                   "need not develop the attention sink the paper's analysis starts from.")
    return out
