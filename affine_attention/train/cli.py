"""`affine-attention train`, and the training half of `affine-attention compare` (the command itself lives in
affine_attention/cli.py, which also writes the report: train never imports analysis); heavy imports happen inside
the handlers."""
from __future__ import annotations

import argparse
import os
import sys
import time


def add_run_options(p: argparse.ArgumentParser, default: str = "tiny") -> None:
    """--config (default: `default`), --set, --out and --resume: shared by train and compare."""
    from .config_load import preset_names  # cheap: no torch

    p.add_argument("--config", default=None, help=f"preset name ({', '.join(preset_names())}) or a TOML file; "
                   f"default: {default}, or with --resume the run's own saved config")
    p.set_defaults(default_config=default)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set train.steps=100 --set optim.lr=3e-4 (repeatable)")
    p.add_argument("--out", default=None, help="run folder (default: train.out_dir, else runs/<command>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest intact checkpoint")


def add_dry_run_options(p: argparse.ArgumentParser) -> None:
    """--dry-run, --world and --gpu: shared by train and compare."""
    p.add_argument("--dry-run", action="store_true", help="print parameter counts, tokens per step, a per-term memory "
                   "estimate and a throughput / wall-clock estimate; no data, no network")
    p.add_argument("--world", type=int, default=None, help="--dry-run: number of GPUs to estimate for "
                   "(default: $WORLD_SIZE or 1)")
    p.add_argument("--gpu", choices=("h100", "h200"), default="h200", help="--dry-run: the GPU whose peak FLOP/s the "
                   "throughput estimate uses (default: h200)")


def dry_run(args, compare: bool = False) -> int:
    """Print the dry run of --config (for compare also the wall clock of every variant x seed)."""
    from .config import Range
    from .dryrun import compare_estimate, dry_run, format_dry_run

    cfg = run_config(args)
    world = args.world if args.world is not None else int(os.environ.get("WORLD_SIZE", "1"))
    Range(integer=True, ge=1).check("--world", world)  # a count of GPUs, as train.* counts are checked
    r = dry_run(cfg, world, args.gpu)
    print(format_dry_run(r, cfg.variant.name))
    if compare:
        from .compare import shares_teacher

        print(compare_estimate(r, len(cfg.compare.variants), args.seeds or cfg.compare.seeds, shares_teacher(cfg)))
    return 0


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("train", help="train (or distil) a causal LM with one attention variant",
                              description="Train one variant; under torchrun uses DDP or FSDP2 (train.parallel).")
    add_run_options(p)
    add_dry_run_options(p)
    p.set_defaults(func=_train)
    e = subparsers.add_parser("export", help="write a run's checkpoint as a transformers folder",
                              description="Write one checkpoint of a train run (a sharded step checkpoint or final/) "
                              "as a transformers-loadable folder: safetensors with the variant, config, tokenizer.")
    e.add_argument("--run", required=True, help="the run folder (train --out)")
    e.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest intact one)")
    e.add_argument("--out", required=True, help="a new folder to write")
    e.set_defaults(func=_export)
    _add_prepare(subparsers)


def _export(args) -> int:
    from .export import export

    path = export(args.run, args.out, args.step)
    print(f"exported {path} to {args.out}")
    return 0


def _add_prepare(subparsers) -> None:
    """`prepare-data` (train/prepare.py)."""
    d = subparsers.add_parser("prepare-data", help="tokenise a config's data source once into token shards",
                              description="Tokenise data.train (or --source eval) of a config in worker processes "
                              "into pre-tokenised shards that `train` reads with data.train.kind = 'tokens'. "
                              "Rerun on an interrupted folder to continue it, on a finished one to verify it.")
    d.add_argument("--config", default="tiny", help="preset name or TOML file whose data source to prepare")
    d.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key (repeatable)")
    d.add_argument("--out", required=True, help="folder for the shards and manifest.json")
    d.add_argument("--source", choices=("train", "eval"), default="train", help="which source (default: train)")
    d.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="tokenizer processes (default: CPU cores - 1)")
    d.add_argument("--shard-documents", type=int, default=100_000, help="documents per shard (default 100000)")
    d.set_defaults(func=_prepare)


def _out_dir(args, cfg, command: str) -> str:
    """The run folder, checked (a name, writable, not a file) before any data or model is built."""
    from pathlib import Path

    from .run_dir import check_out_dir

    if args.out is not None and not args.out.strip():
        raise ValueError("--out is empty; pass a folder for the run (or leave --out out for runs/<command>-<time>)")
    out = args.out or cfg.train.out_dir
    if not out and args.resume:
        raise ValueError("--resume needs the run folder: pass --out DIR (or set train.out_dir)")
    out = out or os.path.join("runs", f"{command}-{time.strftime('%Y%m%d-%H%M%S')}")
    check_out_dir(Path(out), args.resume)
    return out


def run_config(args):
    """The config of train / compare: --config (or the command's default) with --set applied; with --resume and no
    --config, the run's own saved config with --set applied (run_dir.saved_config), so resuming needs no repeat of
    the original flags. Either is then checked against the run's record (a different config is refused)."""
    from pathlib import Path

    from .config_load import apply_overrides, config_from_dict, load_config
    from .run_dir import check_out_dir, check_resume_config, recorded_config, saved_config

    if not (args.resume and args.out):
        return load_config(args.config or args.default_config, args.overrides)
    out = Path(args.out)
    check_out_dir(out, resume=True)  # a missing folder says so before its config is looked for
    if args.config is None:
        cfg = config_from_dict(apply_overrides(saved_config(out), list(args.overrides)),
                               source=f"{args.out} (the run's saved config)")
    else:
        cfg = load_config(args.config, args.overrides)
    recorded = recorded_config(out)
    if recorded is not None:  # refused here, before any model or checkpoint is read
        check_resume_config(recorded, cfg, where="run")
    return cfg


def _train(args) -> int:
    if args.dry_run:
        return dry_run(args)
    cfg = run_config(args)
    from .distributed import teardown
    from .loop import train

    out = _out_dir(args, cfg, "train")
    result = train(cfg, out, resume=args.resume, log=lambda m: print(m, file=sys.stderr, flush=True))
    teardown()  # only after a normal end (see teardown)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"run folder: {out}")
        for key in ("final_train_loss", "heldout_loss", "heldout_ppl", "tokens_per_s", "wall_time_s"):
            if result.get(key) is not None:
                print(f"  {key}: {result[key]:.4f}")
        print(f"  document_mask: {str(result.get('document_mask', False)).lower()} (tokens/s measured with it)")
    return 0


def _prepare(args) -> int:
    from .config_load import load_config
    from .prepare import prepare

    cfg = load_config(args.config, args.overrides)
    prepare(cfg, args.out, which=args.source, workers=args.workers, shard_documents=args.shard_documents,
            log=lambda m: print(m, file=sys.stderr, flush=True))
    return 0


def run_compare(args, after=None) -> tuple[str, bool]:
    """Train and summarise every variant (`compare`); prints summary.md on rank 0. Returns (run folder, is rank 0).
    after: what follows training and its estimated time, for the progress lines (compare.compare's `after`)."""
    from .compare import compare
    from .distributed import teardown

    cfg = run_config(args)
    out = _out_dir(args, cfg, "compare")
    compare(cfg, out, seeds=args.seeds, resume=args.resume, log=lambda m: print(m, file=sys.stderr, flush=True),
            after=after)
    teardown()  # only after a normal end (see teardown)
    main = int(os.environ.get("RANK", "0")) == 0
    if main:
        print((__import__("pathlib").Path(out) / "summary.md").read_text())
    return out, main
