"""`compare`: train every variant of [compare].variants from the same initial weights and data order, per seed.

For each seed k the unconverted base model is built once (seed = train.seed + k) and each variant trains a
converted copy of it, so shared weights start identical; the data order depends only on the seed.
Output layout (run_dir):
  summary.json, summary.md       per variant: parameter overhead, final train loss, held-out loss and
                                 perplexity, tokens/s, wall time (mean and sample std over seeds)
  config.json                    the resolved config
  comparison.json                the manifest: variants, seeds and the runs it holds (readers read only those)
  .lock                          held by the comparing process (run_dir.RunLock), as a run's folder
  <variant>/seed<k>/metrics.jsonl, result.json, final/   each run (see run_dir.py); final/ is transformers-loadable
A report can be regenerated later from these files alone. Every check of the folder runs before the first write:
a used folder without --resume, or a different comparison (variants, seeds, config) with it, is refused unchanged.

With a live KD teacher (compare.share_teacher), a seed's variants see the same batches, so they are stepped in
lockstep in this process and share one teacher forward per micro-batch (kd.Teacher.share) instead of running the
teacher once per variant; each run's numbers are those it gets alone.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from .._environment import hardware, versions
from .._files import COMPARISON, atomic_write_json, atomic_write_text, read_comparison, read_json
from .._numbers import FINAL_LOSS_WINDOW, mean_std
from ..variants import REFERENCE
from .config import CompareConfig, RunConfig, config_json, field_range
from .run_dir import RunLock, check_out_dir, check_resume_config, read_result

METRICS = [("final_train_loss", "final train loss", "{:.4f}"), ("heldout_loss", "held-out loss", "{:.4f}"),
           ("heldout_ppl", "held-out ppl", "{:.2f}"), ("tokens_per_s", "tokens/s", "{:,.0f}"),
           ("wall_time_s", "wall time (s)", "{:.1f}")]


def summarize(results: dict[str, list[dict[str, Any]]], baseline: str = REFERENCE) -> dict[str, Any]:
    """Per variant mean/std of each metric over seeds, with the parameter overhead against `baseline`."""
    base_params = results[baseline][0]["params"] if baseline in results else None
    out: dict[str, Any] = {}
    for variant, runs in results.items():
        entry: dict[str, Any] = {"seeds": len(runs), "params": runs[0]["params"],
                                 "param_overhead": runs[0]["params"] - base_params if base_params is not None else None}
        for key, _, _ in METRICS:
            mean, std, _ = mean_std([r.get(key) for r in runs])
            entry[key] = {"mean": mean, "std": std, "values": [r.get(key) for r in runs]}
        out[variant] = entry
    if base_params is not None:
        base_tps = out[baseline]["tokens_per_s"]["mean"]
        for entry in out.values():
            tps = entry["tokens_per_s"]["mean"]
            entry["tokens_per_s_vs_baseline"] = tps / base_tps if tps and base_tps else None
    return out


def markdown(summary: dict[str, Any], title: str) -> str:
    def cell(m: dict, fmt: str) -> str:
        if m["mean"] is None:
            return "-"
        return fmt.format(m["mean"]) + (f" ± {fmt.format(m['std'])}" if m["std"] is not None else "")

    head = ["variant", "Δparams"] + [label for _, label, _ in METRICS] + [f"tok/s vs {REFERENCE}"]
    lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, e in summary.items():
        over = "-" if e["param_overhead"] is None else f"{e['param_overhead']:,}"
        ratio = e.get("tokens_per_s_vs_baseline")
        row = [variant, over] + [cell(e[k], fmt) for k, _, fmt in METRICS] + ["-" if ratio is None else f"{ratio:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    seeds = {e["seeds"] for e in summary.values()}
    lines += ["", f"Mean ± sample std over {', '.join(map(str, sorted(seeds)))} seed(s) (no ± with one seed). "
              f"Final train loss: mean over the last {FINAL_LOSS_WINDOW:.0%} of steps. Held-out loss: mean "
              "next-token cross-entropy on the eval source; perplexity = exp(loss). Wall time includes evaluation and "
              "checkpoints."]
    return "\n".join(lines) + "\n"


def overall_line(i: int, n: int, elapsed_s: float, trained: int, left: int,
                 after: tuple[str, float] | None = None) -> str:
    """The one overall progress line of a compare: run i of n, the time so far and an estimate of the time left.

    trained: runs trained so far in this invocation (resumed ones cost nothing, so they do not enter the rate);
    left: runs still to train, this one included. The estimate assumes the remaining runs cost what the trained ones
    did on average (every run of a compare has the same steps and model size, variants differ by a few percent);
    before the first run has finished there is no rate, and the line says so instead of guessing. after: (what, its
    estimated seconds), the work that follows training (the report), included in the time left."""
    then = f"{after[0]} about {_clock(after[1])}" if after else None
    if not trained:
        eta = "time left known after the first run" + (f"; then {then}" if then else "")
    elif then:
        train_s = elapsed_s / trained * left
        eta = f"about {_clock(train_s + after[1])} left (training {_clock(train_s)}, then {then})"
    else:
        eta = f"about {_clock(elapsed_s / trained * left)} left"
    return f"[compare] run {i} of {n}, {_clock(elapsed_s)} elapsed, {eta}"


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def shares_teacher(cfg: RunConfig) -> bool:
    """Whether compare steps a seed's variants in lockstep on one live teacher (a top-k cache is shared anyway)."""
    return cfg.compare.share_teacher and cfg.kd.enabled and not cfg.kd.cache and len(cfg.compare.variants) > 1


def lockstep(cfg: RunConfig, runs: list[tuple[str, Path, bool]], *, base_model, seed: int, log=print) -> list[dict]:
    """Train runs [(variant, run folder, resume)] of one seed step by step side by side, sharing the first run's
    KD teacher and its forward of each micro-batch; returns their summaries in order. A run resumed from an older
    checkpoint than its peers' (killed between their saves) trains alone until it catches up, then in lockstep."""
    from .loop import Trainer
    from .model import variant_options

    trainers: list[Trainer] = []
    try:
        for variant, run_dir, resume in runs:
            trainers.append(Trainer(cfg, run_dir, resume=resume, base_model=base_model, variant=variant,
                                    variant_options=variant_options(cfg, variant), label=f"{variant} s{seed}", log=log,
                                    teacher=trainers[0].teacher if trainers else None))
        trainers[0].teacher.share(trainers[0].n_micro)
        done = [t.open_run() for t in trainers]
        live = [t for t, d in zip(trainers, done) if d is None]
        for s in range(min((t.start_step for t in live), default=cfg.train.steps), cfg.train.steps):
            for t in live:
                if s >= t.start_step:  # a run killed between its peers' checkpoints resumes a step behind
                    t.train_step(s)
                    t.on_schedule(s + 1)
        return [d if d is not None else t.close_run() for t, d in zip(trainers, done)]
    finally:
        for t in trainers:
            t.close()


def comparison(cfg: RunConfig, seeds: int) -> dict[str, Any]:
    """The manifest of a compare folder: its variants, seeds and runs (<variant>/seed<k>), in run order."""
    variants = list(cfg.compare.variants)
    return {"format": 1, "variants": variants, "seeds": seeds,
            "runs": [f"{v}/seed{k}" for k in range(seeds) for v in variants]}


def check_compare_dir(out_dir: Path, cfg: RunConfig, seeds: int, resume: bool) -> None:
    """Every check of a comparison's folder, before anything is written into it: a writable --out; without
    --resume, a folder holding no comparison; with it, the same comparison (variants, seeds, config)."""
    check_out_dir(out_dir, resume)
    if not out_dir.is_dir():
        return
    if not resume:
        held = [n for n in ("config.json", "summary.json", COMPARISON) if (out_dir / n).exists()]
        held += sorted({p.parent.name for p in out_dir.glob("*/seed*")})
        if held:
            raise ValueError(f"{out_dir} already holds a comparison ({', '.join(held[:6])}); pass --resume to "
                             "continue it or choose another --out (nothing was changed)")
        return
    saved = read_comparison(out_dir)
    want = comparison(cfg, seeds)
    if saved is not None:
        diff = [f"{k}: folder {saved.get(k)!r}, now {want[k]!r}" for k in ("variants", "seeds") if saved.get(k) != want[k]]
        if diff:
            raise ValueError(f"--resume {out_dir}: a different comparison ({'; '.join(diff)}); resume with the "
                             "comparison's own variants and --seeds, or compare into another --out (nothing was "
                             "changed)")
    if (out_dir / "config.json").is_file():
        check_resume_config(read_json(out_dir / "config.json", "restore it or compare into a new --out"), cfg,
                            where="comparison")


def check_variants(names: list[str]) -> None:
    """compare.variants before anything trains: a typo found at the third variant would cost the first two runs."""
    import difflib

    from ..variants import variant_names

    known = variant_names()
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            raise ValueError(f"compare.variants: unknown variant {name!r}"
                             + (f" (did you mean {close[0]!r}?)" if close else "")
                             + f"; choose from {', '.join(known)} (nothing was trained)")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"compare.variants names {', '.join(twice)} more than once; list each variant once")


def compare(cfg: RunConfig, out_dir: str | Path, *, seeds: int | None = None, resume: bool = False,
            log=print, after=None) -> dict[str, Any]:
    """Train every variant for every seed (`seeds`, default compare.seeds) into out_dir and write summary.json /
    summary.md (see module doc). after: None, or a function of (the config as a dict, the number of runs) giving
    (what follows training, its estimated seconds) for the progress lines' time left (the command's report)."""
    from .distributed import setup

    out_dir = Path(out_dir)
    if seeds is None:
        seeds = cfg.compare.seeds
    field_range(CompareConfig, "seeds").check("--seeds", seeds)  # the range compare.seeds declares
    check_variants(cfg.compare.variants)
    # Every rank, before rank 0 writes: setup's rendezvous waits for every rank, so none checks after the writes.
    check_compare_dir(out_dir, cfg, seeds, resume)
    info = setup(cfg.train.device)
    lock = None
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(out_dir)
        try:
            check_compare_dir(out_dir, cfg, seeds, resume)  # again, now that no other compare can write meanwhile
            atomic_write_json(out_dir / COMPARISON, comparison(cfg, seeds))
            atomic_write_text(out_dir / "config.json", config_json(cfg))
        except BaseException:
            lock.release()
            raise
    try:
        then = after(cfg.to_dict(), seeds * len(cfg.compare.variants)) if after is not None else None
        return _compare(cfg, out_dir, seeds, resume, info, log, then)
    finally:
        if lock is not None:
            lock.release()


def _compare(cfg: RunConfig, out_dir: Path, seeds: int, resume: bool, info, log,
             after: tuple[str, float] | None) -> dict[str, Any]:
    """compare() once its folder is checked, held and its manifest written."""
    from .loop import train
    from .model import base_model, tokenizer_spec, variant_options
    from .pretrained import load_tokenizer

    tok = load_tokenizer(tokenizer_spec(cfg))
    t0 = time.time()
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in cfg.compare.variants}
    n_runs = seeds * len(cfg.compare.variants)
    todo = [(k, v) for k in range(seeds) for v in cfg.compare.variants
            if not (resume and (out_dir / v / f"seed{k}" / "result.json").is_file())]
    trained = 0
    for k in range(seeds):
        seed_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=cfg.train.seed + k))
        base = base_model(cfg, seed_cfg.train.seed, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        if shares_teacher(cfg):
            runs = [(v, out_dir / v / f"seed{k}", resume and (out_dir / v / f"seed{k}" / "metrics.jsonl").is_file())
                    for v in cfg.compare.variants if (k, v) in todo]
            for v in cfg.compare.variants:
                if (k, v) not in todo:
                    log(f"[compare] {v} seed {k}: already done, reusing {out_dir / v / f'seed{k}' / 'result.json'}")
            log(overall_line(k * len(cfg.compare.variants) + 1, n_runs, time.time() - t0, trained,
                             len(todo) - trained, after)
                + f"; seed {k}: {', '.join(v for v, _, _ in runs)} in lockstep, one teacher forward shared")
            got = dict(zip([v for v, _, _ in runs], lockstep(seed_cfg, runs, base_model=base, seed=k, log=log)
                           if runs else []))
            for v in cfg.compare.variants:
                results[v].append(got[v] if v in got else read_result(out_dir / v / f"seed{k}"))
            trained += len(runs)
            continue
        for variant in cfg.compare.variants:
            run_dir = out_dir / variant / f"seed{k}"
            done = run_dir / "result.json"
            if resume and done.is_file():
                log(f"[compare] {variant} seed {k}: already done, reusing {done}")
                results[variant].append(read_result(run_dir))
                continue
            log(overall_line(k * len(cfg.compare.variants) + cfg.compare.variants.index(variant) + 1, n_runs,
                             time.time() - t0, trained, len(todo) - trained, after))
            log(f"[compare] {variant} seed {k} -> {run_dir}")
            partial = resume and (run_dir / "metrics.jsonl").is_file()
            results[variant].append(train(seed_cfg, run_dir, resume=partial, base_model=base, variant=variant,
                                          variant_options=variant_options(cfg, variant),
                                          label=f"{variant} s{k}", log=log))
            trained += 1
    log(f"[compare] {n_runs} of {n_runs} runs done in {_clock(time.time() - t0)}"
        + (f"; then {after[0]} about {_clock(after[1])}" if after else ""))
    summary = {"variants": summarize(results), "seeds": seeds, "total_wall_time_s": time.time() - t0,
               "config": cfg.to_dict(), "hardware": hardware(), "versions": versions()}
    if info.is_main:
        atomic_write_json(out_dir / "summary.json", summary)
        masking = ("does not apply (data.train.kind = 'backcopy': one generated sequence per row)"
                   if cfg.data.train.kind == "backcopy" else "per document (data.document_mask = true)"
                   if cfg.data.document_mask else "across document boundaries (data.document_mask = false)")
        atomic_write_text(out_dir / "summary.md",
                          markdown(summary["variants"], f"compare: {out_dir.name}") +
                          f"\nAttention in packed rows: {masking}; tokens/s are measured so.\n"
                          f"\nTotal wall time: {summary['total_wall_time_s']:.0f} s.\n")
    return summary
