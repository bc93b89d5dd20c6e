"""The report's tables: the set-up, losses and zero-shot accuracy (Table 1), gradient-norm statistics (Table 2) and
methods against their controls (Table 3), with the formatting and paired differences the report's prose reuses."""
from __future__ import annotations

import math

from .._environment import hardware, versions
from .._numbers import FINAL_LOSS_WINDOW, mean_std
from ..variants import REFERENCE as BASELINE
from ..variants import REGISTRY, control_pairs
from . import claims
from .compare_run import (SeedRun, final_train_loss, heldout, reference_run, role_of, run_config, run_steps,
                          zero_shot_accuracies)
from .report_template import Table

__all__ = ["fmt_seeds", "paired", "loss_verdict", "setup_rows", "losses_table", "grad_table", "control_table"]


def fmt_seeds(values, fmt: str = "{:.4f}") -> str:
    """'mean ± sample std' over seeds ('mean' alone with one value, '-' with none); a '+' in fmt signs the mean."""
    m, s, _ = mean_std(values)
    if m is None:
        return "-"
    return fmt.format(m) + (f" ± {fmt.replace('+', '').format(s)}" if s is not None else "")


def paired(numbers: dict, a: str, b: str, key: str) -> list[float]:
    """a − b per seed, over the seeds where both have a value."""
    x, y = numbers[a][key], numbers[b][key]
    return [x[s] - y[s] for s in x if s in y and x[s] is not None and y[s] is not None]


def loss_verdict(numbers: dict, a: str, b: str, key: str) -> str:
    """The Claims rule's verdict (claims.verdict, marked) on a − b of loss `key` ("final_train_loss" or
    "heldout_loss"; lower is claimed), its minimum effect scaled by the baseline's mean (b's without a baseline)."""
    ref = BASELINE if BASELINE in numbers else b
    scale = mean_std(list(numbers[ref][key].values()))[0]
    return claims.marked(claims.verdict(paired(numbers, a, b, key), -1, claims.MIN_EFFECT[key].of(scale)))


def _source(src: dict) -> str:
    kind = src.get("kind", "?")
    if kind == "corpus":
        return f"packaged corpus, {src.get('split', '?')} split"
    if kind == "backcopy":
        return f"Bigram-Backcopy task, {src.get('split', '?')} split"
    if kind == "files":
        return "files " + ", ".join(src.get("paths", []))
    return f"{kind} {src.get('name', '')} {src.get('subset', '')} ({src.get('split', '')})".replace("  ", " ")


def _count(n, noun: str) -> str:
    """'1 head', '4 heads', '? heads' (not recorded)."""
    return f"{n} {noun}" if n == 1 else f"{'?' if n is None else n} {noun}s"


def setup_rows(summary: dict, runs: dict[str, list[SeedRun]]) -> list[list[str]]:
    """The set-up table's (item, value) rows: model, data, training, objective, variants, hardware, versions."""
    cfg = run_config(summary, runs)
    m, d, t, o, s, kd = (cfg.get(k, {}) for k in ("model", "data", "train", "optim", "schedule", "kd"))
    steps = run_steps(runs)
    steps = "?" if steps is None else steps
    seq, gb = d.get("seq_len"), t.get("global_batch")
    tokens = steps * seq * gb if all(isinstance(x, int) for x in (steps, seq, gb)) else None
    base = reference_run(runs)
    params = base.params
    src = d.get("train", {})
    rows = [
        ["model", f"{m.get('arch', '?')}: {_count(m.get('num_layers'), 'layer')}, hidden {m.get('hidden_size', '?')}, "
                  f"{_count(m.get('num_heads'), 'head')} / {_count(m.get('num_kv_heads'), 'KV head')}, vocab "
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
    throughput = throughput_cell([r.result for rs in runs.values() for r in rs])
    if throughput:
        rows.append(["throughput", throughput])
    return rows


def throughput_cell(results: list[dict]) -> str | None:
    """Tokens/s, MFU, data wait and host syncs per step, means over the runs' result.json (train/loop.run_cost)."""
    def mean(key):
        xs = [r[key] for r in results if isinstance(r.get(key), (int, float))]
        return sum(xs) / len(xs) if xs else None

    tps = mean("tokens_per_s")
    if tps is None:
        return None
    mfu, wait, syncs = mean("mfu"), mean("data_wait_s_per_step"), mean("host_syncs_per_step")
    return "; ".join([
        f"{tps:,.0f} tokens/s (mean over runs)",
        f"MFU {mfu:.1%} (student and teacher model FLOPs over the device's bf16 dense peak)" if mfu is not None
        else "MFU not measured (a CPU, or a GPU without a listed peak)",
        f"data wait {wait * 1e3:.1f} ms/step" if wait is not None else "data wait not recorded",
        f"{syncs:.1f} host syncs/step" if syncs is not None else "host syncs counted on CUDA only"])


def losses_table(summary: dict, runs: dict[str, list[SeedRun]]) -> tuple[Table, dict]:
    """Table 1 and the per-seed losses it shows: numbers[variant]["final_train_loss" | "heldout_loss"][seed]."""
    sv = summary.get("variants", {})
    zs = {v: zero_shot_accuracies(sv.get(v, {}), rs) for v, rs in runs.items()}
    tasks = list(dict.fromkeys(t for z in zs.values() for t in z))
    header = ["variant", "role", "Δparams", "final train loss", "held-out loss", "held-out ppl"] + tasks
    base_params = runs[BASELINE][0].result.get("params") if BASELINE in runs else None
    rows, numbers = [], {}
    for v, rs in runs.items():
        over = sv.get(v, {}).get("param_overhead")
        if over is None and base_params is not None and rs[0].result.get("params") is not None:
            over = rs[0].result["params"] - base_params
        ftl = [final_train_loss(r) for r in rs]
        hl = [heldout(r, "heldout_loss") for r in rs]
        ppl = [heldout(r, "heldout_ppl") if heldout(r, "heldout_ppl") is not None
               else (math.exp(h) if h is not None else None) for r, h in zip(rs, hl)]
        numbers[v] = {"final_train_loss": dict(zip([r.seed for r in rs], ftl)),
                      "heldout_loss": dict(zip([r.seed for r in rs], hl))}
        row = [v, role_of(v),
               "-" if over is None else f"{over:,}", fmt_seeds(ftl), fmt_seeds(hl), fmt_seeds(ppl, "{:.2f}")]
        row += [fmt_seeds(zs[v].get(t, []), "{:.1f}") for t in tasks]
        rows.append(row)
    n = sorted({len(rs) for rs in runs.values()})
    cap = (f"Mean ± sample std over {'/'.join(map(str, n))} seed(s) (no ± with one seed). Final train loss: mean "
           f"over the last {FINAL_LOSS_WINDOW:.0%} of steps. Held-out loss: mean next-token cross-entropy at the last "
           f"evaluation; perplexity = exp(loss). Δparams: extra parameters against {BASELINE}.")
    if tasks:
        cap += " Zero-shot accuracy in %."
    return Table(header, rows, cap, "Table 1. Loss, perplexity" + (" and zero-shot accuracy" if tasks else "")), \
        numbers


def grad_table(runs: dict[str, list[SeedRun]], window: tuple[int, int], label: str) -> tuple[Table, dict]:
    """Table 2 and its per-seed statistics: variant -> [gradstats of each seed that logged gradient norms]."""
    header = ["variant", "mean", "std", "variance", "CV", "spikes k=6", "spikes k=9"]
    rows, stats = [], {}
    for v, rs in runs.items():
        per = [g for r in rs if (g := r.grad_stats(window)) is not None]
        stats[v] = per
        if not per:
            rows.append([v] + ["-"] * 6)
            continue
        cells = [("mean", "{:#.3g}"), ("std", "{:#.3g}"), ("variance", "{:#.3g}"), ("cv", "{:.3f}")]
        rows.append([v] + [fmt_seeds([p[k] for p in per], f) for k, f in cells]
                    + [fmt_seeds([p["spikes"][k] for p in per], "{:.1f}") for k in (6, 9)])
    cap = (f"Pre-clip global gradient norm over {label}, mean ± sample std over seeds of each seed's statistic. "
           "Variance and std are population moments over the steps; CV = std / mean; a spike is a step whose norm "
           "exceeds median + k x MAD (raw median absolute deviation) of the same window.")
    return Table(header, rows, cap, "Table 2. Gradient-norm statistics (paper Tables 4-5)"), stats


def control_table(numbers: dict) -> Table | None:
    """Table 3: each method against each of its registered controls in the run, paired by seed, each loss with the
    Claims rule's verdict (the same numbers and verdicts as the Claims rows on the losses); None without a control."""
    rows, isolates = [], {}
    for v, c in control_pairs(numbers):
        held, train = paired(numbers, v, c, "heldout_loss"), paired(numbers, v, c, "final_train_loss")
        rows.append([f"{v} − {c}", str(len(held)), fmt_seeds(held, "{:+.4f}"),
                     loss_verdict(numbers, v, c, "heldout_loss"), fmt_seeds(train, "{:+.4f}"),
                     loss_verdict(numbers, v, c, "final_train_loss")])
        isolates[c] = REGISTRY[c].isolates
    if not rows:
        return None
    reading = "; ".join(f"method − {c} isolates {what}" for c, what in isolates.items() if what)
    least = ", ".join(f"{claims.MIN_EFFECT[k].words(BASELINE)} for {k}" for k in ("heldout_loss", "final_train_loss"))
    cap = ("Differences paired by seed (same initial weights and data order), mean ± sample std over seeds; "
           "negative = the method has the lower loss. Each verdict is the Claims rule's on that column (lower loss "
           f"claimed; minimum effect {least}), so it matches the Claims rows 'lower held-out perplexity' and "
           "'lower training loss' wherever the pair is there too."
           + (f" {reading[0].upper()}{reading[1:]}." if reading else ""))
    header = ["method − control", "paired seeds", "Δ held-out loss", "verdict", "Δ final train loss", "verdict"]
    return Table(header, rows, cap, "Table 3. Methods against their controls")
