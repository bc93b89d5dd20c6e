"""`write_report(run_dir)`: report.md and a self-contained report.html for a `compare` run directory, rebuilt from
its saved metrics (summary.json, <variant>/seed<k>/metrics.jsonl, result.json) and final checkpoints; no training."""
from __future__ import annotations

from pathlib import Path

from .._files import atomic_write_text
from .._progress import phase
from .compare_run import grad_window, load_run, run_config
from .report_claims import claims_blocks, claims_data, record_claims, summary_blocks
from .report_figures import attention_figures, attention_records, training_figures
from .report_probe import probe_blocks, probe_data, probe_task, summary_record
from .report_prose import controls_note, honest, paper_method, title
from .report_tables import control_table, grad_table, losses_table, setup_rows
from .report_template import Heading, Para, Table, to_html, to_markdown

__all__ = ["write_report", "checkpoints_read", "estimate"]

PROBE_SEQUENCES = 64  # held-out task sequences for the sink measurements (cheap: the probe models are tiny)
# Seconds the report spends per checkpoint it loads (the load, then the attention diagnostics or the sink
# measurements), measured: the default compare's report read 240 checkpoints in 146 s on this project's 2 shared CPU
# cores. Only for compare's estimate of the time left; larger models and other machines differ.
S_PER_CHECKPOINT = 0.6


def checkpoints_read(cfg: dict, runs: int) -> int:
    """How many checkpoints write_report loads for `runs` runs of config `cfg` (a dict): each final one for the
    attention diagnostics and, on the Bigram-Backcopy probe, every kept periodic one and the final for the sink
    measurements."""
    t = cfg.get("train", {})
    every, steps = t.get("checkpoint_every") or 0, t.get("steps") or 0
    kept = min(t.get("keep_checkpoints") or 0, steps // every) if every else 0
    return runs * (1 + (kept + 1 if probe_task(cfg) is not None else 0))


def estimate(cfg: dict, runs: int) -> tuple[str, float]:
    """(what, seconds): the report of a compare of `runs` runs, as compare's progress lines count it."""
    return "the report", S_PER_CHECKPOINT * checkpoints_read(cfg, runs)


def write_report(run_dir: str | Path, *, sequences: int = 4, length: int | None = None, attention: bool = True,
                 window: tuple[int, int] | int = 500, chunk: int = 256) -> dict[str, Path]:
    """Write run_dir/report.md, run_dir/report.html (self-contained) and run_dir/figures/*.png; return their paths.

    sequences, length: held-out windows for the attention diagnostics of every final checkpoint (figures: the first
    seed; the Claims table: every seed; length defaults to the run's seq_len); attention=False skips them. window:
    gradient statistics over the first `window` steps (an int, or a (0, end) pair as accepted by the CLI), or the
    whole run when it is shorter.
    """
    run_dir = Path(run_dir)
    summary, runs = load_run(run_dir)
    cfg = run_config(summary, runs)
    figdir = run_dir / "figures"
    gwin, glabel = grad_window(runs, window if isinstance(window, int) else int(window[1]))
    t1, numbers = losses_table(summary, runs)
    t2, grad = grad_table(runs, gwin, glabel)
    t3 = control_table(numbers)
    # Progress on stderr (_progress.phase): the report of a compare run takes minutes, mostly the checkpoints'
    # attention diagnostics, and must not look stuck.
    with phase("report: training figures"):
        figs = training_figures(runs, figdir, bool(cfg.get("kd", {}).get("enabled")), gwin, glabel)
    attn: dict = {}
    by_seed: dict = {}
    length = length or cfg.get("data", {}).get("seq_len") or 128
    if attention:
        checkpoints = sum(len(rs) for rs in runs.values())
        with phase(f"report: attention diagnostics of {checkpoints} final checkpoints"):
            by_seed, note = attention_records(runs, cfg, sequences, length, chunk)
            attn = {v: recs[min(recs)] for v, recs in by_seed.items()}  # figures: each variant's first seed
            figs += attention_figures(runs, attn, note, figdir)
    probe, sink = None, None
    if attention and probe_task(cfg) is not None:  # the Bigram-Backcopy probe: the sink test reads dormant queries
        with phase("report: sink probe measurements"):
            probe = probe_data(runs, cfg, max(sequences, PROBE_SEQUENCES))
        sink = (probe["reference_sink"], f"dormant (non-trigger) queries' first-token softmax mass at least "
                f"{probe['factor']:g}x their uniform share at the probe's layer, mean over seeds")
    extra = None
    if probe is not None:
        L = probe["layer"]
        extra = {v: {s: {"dormant_first_token_mass": next(x["w_first"]["dormant"] for x in m["layers"]
                                                           if x["layer"] == L)}
                     for s, m in d["per_seed"].items()} for v, d in probe["variants"].items()}
    claims = claims_data(runs, numbers, gwin, by_seed, length, sink, extra)
    # The answer first (the paper's method's claims), then the evidence it rests on.
    lead = (paper_method(),) if paper_method() in claims["methods"] else ()
    blocks: list = [Heading(title(run_dir.name), 1)] + (summary_blocks(claims, lead[0]) if lead else [])
    blocks += [Heading("Set-up"), Table(["item", "value"], setup_rows(summary, runs), key_value=True),
               Heading("Results"), t1, t2]
    controls = controls_note(runs)
    if controls:
        blocks.append(Para(controls))
    if t3 is not None:
        blocks.append(t3)
    blocks += claims_blocks(claims, skip=lead)
    if probe is not None:
        blocks += probe_blocks(probe, figdir)
    record_claims(run_dir, summary, claims, {"sink_probe": summary_record(probe)} if probe is not None else None)
    blocks += [Heading("What this run shows and does not show")]
    blocks += [Para(p) for p in honest(runs, numbers, grad, glabel, attn)]
    blocks += [Heading("Figures")] + figs
    md, html_path = run_dir / "report.md", run_dir / "report.html"
    atomic_write_text(md, to_markdown(blocks, run_dir))
    atomic_write_text(html_path, to_html(blocks, f"affine-attention report: {run_dir.name}"))
    return {"md": md, "html": html_path, "figures": figdir}
