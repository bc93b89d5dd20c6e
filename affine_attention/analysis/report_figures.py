"""The report's figures and their captions: training curves from the metrics logs and the attention diagnostics of
the final checkpoints; a caption that names variants picks them by what the registry says they do."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..text import documents
from ..variants import REFERENCE, REGISTRY
from . import plots
from .analyze import load_model, record, token_windows, write_figures
from .compare_run import BEFORE, SeedRun
from .report_template import Figure, Para

__all__ = ["attention_caption", "training_figures", "attention_records", "attention_figures"]

_ATTENTION_CAPTIONS = {
    "first_token_mass": "Mean attention weight on the first token per layer (paper Fig. 4).",
    "entropy": "Mean attention entropy per layer, in nats (paper Fig. 6).",
    "head_mass": "Layer x head total attention mass on non-first tokens, min-max normalised per model (paper "
                 "Fig. 5){sink}.",
    "mass_histogram": "Per-query total attention mass on non-first tokens, all layers and heads (paper Fig. 3).",
    "attention_map": "Head-averaged attention weights of the middle layer, first 30 tokens (paper Fig. 7); a "
                     "diverging scale when some weight is negative{signed}.",
    "alpha_histogram": "Distribution of α over tokens, layers and heads (paper Fig. 8); a frozen (constant) α is "
                       "left out.",
}


def attention_caption(key: str, variants) -> str:
    """The caption of attention figure `key` for a run of `variants`: the variants with a learned sink (their
    sink's share is left out of the head mass) and those whose weights carry an affine bias term (the ones that
    can be negative) are named when the run has any."""
    sinks = [v for v in variants if v in REGISTRY and REGISTRY[v].needs_lse]
    signed = [v for v in variants if v in REGISTRY and REGISTRY[v].uses_value_mean]
    return _ATTENTION_CAPTIONS[key].format(
        sink=f"; for {', '.join(sinks)} the sink's share is excluded" if sinks else "",
        signed=f" ({', '.join(signed)})" if signed else "")


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


def _token_stats(runs: dict[str, list[SeedRun]]) -> dict[str, str]:
    """key -> label of the per-token statistics the run's variants declare (variant.token_stats), in run order."""
    out: dict[str, str] = {}
    for v in runs:
        if v in REGISTRY:
            for key, label in REGISTRY[v].token_stats.items():
                out.setdefault(key, label)
    return out


def training_figures(runs: dict[str, list[SeedRun]], figdir: Path, kd: bool, gwin: tuple[int, int],
                     glabel: str) -> list[Figure]:
    """Loss, held-out loss, gradient norm, QK logit and per-token statistic curves from the metrics logs."""
    figs: list[Figure] = []
    steps_max = max((len(r.train) for rs in runs.values() for r in rs), default=1)
    smooth = max(1, steps_max // 60)
    loss = {v: c for v, rs in runs.items() if (c := _mean_curve(rs, "loss")) is not None}
    if loss:
        ref = REFERENCE if REFERENCE in loss and len(loss) > 1 else None
        figs.append(Figure(plots.plot_loss_curves(loss, figdir / "loss.png", smooth=smooth, reference=ref,
                                                  title="Training loss" + (" (KD objective)" if kd else "")),
                           "Training loss, mean over seeds" +
                           (f" (moving average over {smooth} steps)" if smooth > 1 else "") +
                           (f"; right: each variant minus {ref} over the last 30% of steps (same initial weights "
                            "and data, so the difference is the variant's effect plus seed noise)" if ref else
                            "; right: the last 30% of steps") + "."))
    held = {v: c for v, rs in runs.items() if (c := _mean_curve(rs, "heldout_loss", "eval")) is not None
            and c[0].size > 1}
    if held:
        # Evaluations are sparse: zoom on the last three of them, so every zoomed line has its end points.
        ev = sorted({float(x) for steps, _ in held.values() for x in steps})
        frac = min(1.0, (ev[-1] - ev[max(0, len(ev) - 3)]) / (ev[-1] - ev[0]) if ev[-1] > ev[0] else 1.0) or 1.0
        ref = REFERENCE if REFERENCE in held and len(held) > 1 else None
        figs.append(Figure(plots.plot_loss_curves(held, figdir / "heldout_loss.png", zoom_last_frac=frac,
                                                  title="Held-out loss", ylabel="held-out loss", reference=ref),
                           "Held-out next-token loss at each evaluation, mean over seeds; right: the last three "
                           "evaluations" + (f", each variant minus {ref}." if ref else ".")))
    gn = {v: rs[0].series("grad_norm") for v, rs in runs.items() if rs[0].series("grad_norm")[0].size}
    if gn:
        # A window that covers the whole run would repeat the full panel: then there is one panel, and it is Table 2's.
        whole = all(s.min() >= gwin[0] and s.max() < gwin[1] for s, _ in gn.values())
        figs.append(Figure(plots.plot_grad_norms(gn, figdir / "grad_norm.png",
                                                 window=None if whole else (gwin[0], gwin[1] - 1)),
                           "Pre-clip gradient norm of the first seed (not averaged: averaging hides spikes)" +
                           (f"; {glabel}, the window of Table 2." if whole else
                            f"; right: {glabel}, the window of Table 2.")))
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


def _heldout_texts(cfg: dict) -> tuple[list[str], str]:
    src = cfg.get("data", {}).get("eval", {})
    if src.get("kind") == "files" and src.get("paths"):
        return list(documents("files", paths=src["paths"], text_field=src.get("text_field", "text"))), \
            "the run's held-out files"
    split = src.get("split", "validation") if src.get("kind", "corpus") == "corpus" else "validation"
    return list(documents("corpus", split=split)), f"the packaged corpus ({split} split)"


def attention_records(runs: dict[str, list[SeedRun]], cfg: dict, sequences: int, length: int, chunk: int):
    """variant -> seed -> LayerRecords of that run's final checkpoint on the first held-out windows, plus the
    pretrained model a retrofit started from (key BEFORE); (records, note)."""
    from .report_probe import probe_ids, probe_task

    out: dict = {}
    if probe_task(cfg) is not None:  # a synthetic task: its held-out sequences, not text in its tiny vocabulary
        ids = probe_ids(cfg, sequences)[:, :length]
        note = "the run's held-out Bigram-Backcopy sequences"
    else:
        texts, note = _heldout_texts(cfg)

    def rec(spec: str):
        model, tok, _ = load_model(spec)
        return record(model, ids if probe_task(cfg) is not None else token_windows(tok, texts, sequences, length),
                      chunk=chunk)

    init_from = cfg.get("model", {}).get("init_from")
    if init_from:
        out[BEFORE] = {0: rec(init_from)}
    for v, rs in runs.items():
        for r in rs:
            if (r.final / "config.json").is_file():
                out.setdefault(v, {})[r.seed] = rec(str(r.final))
    return out, f"{sequences} windows of {length} tokens from {note}"


def attention_figures(runs: dict[str, list[SeedRun]], attn: dict, note: str, figdir: Path) -> list:
    """The attention diagnostics' figures of `attn` (variant -> LayerRecords of its first seed), captioned, and a
    note naming the variants without a final checkpoint."""
    figs: list = []
    if attn:
        figs += [Figure(path, f"{attention_caption(key, attn)} Final checkpoints (first seed), {note}.")
                 for key, path in write_figures(attn, figdir).items()]
    missing = [v for v in runs if v not in attn]
    if missing:
        figs.append(Para(f"No attention diagnostics for {', '.join(missing)}: no final checkpoint."))
    return figs
