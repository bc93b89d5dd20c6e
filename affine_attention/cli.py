"""The `affine-attention` command: thin entry points; each area adds its own subcommands."""
from __future__ import annotations

import argparse
import importlib
import sys

# Modules that define `add_commands(subparsers)`; each must import cheaply (heavy imports inside handlers).
AREAS = (
    "affine_attention.train.cli",
    "affine_attention.hf.cli",
    "affine_attention.eval.cli",
    "affine_attention.analysis.cli",
    "affine_attention.serving.vllm_cpu_alias",
)


# The default comparison: the Bigram-Backcopy probe, because it is the setting at CPU scale in which the paper's
# mechanism (the attention sink) forms and can be tested, and it runs every variant and both controls x 3 seeds in
# about a third of the language-model comparison's time (measurements: docs/studies.md).
DEFAULT_COMPARE = "sink-probe"


def _add_compare(sub) -> None:
    """`compare` spans two floors (train, then the analysis report), so it is defined here, above both."""
    from .train.cli import add_dry_run_options, add_run_options

    c = sub.add_parser("compare", help="train every variant from the same start and summarise",
                       description="Train each variant of [compare].variants with the same seed, initial "
                       "weights and data order; write summary.json and summary.md. With no arguments runs "
                       f"the {DEFAULT_COMPARE} preset offline (every variant and both controls, 3 seeds, where "
                       "softmax forms an attention sink); --config tiny runs the language-model comparison.")
    add_run_options(c, DEFAULT_COMPARE)
    c.add_argument("--seeds", type=int, default=None, help="number of seeds (default: compare.seeds)")
    add_dry_run_options(c)
    c.add_argument("--no-report", dest="report", action="store_false",
                   help="skip report.md / report.html (regenerate later with `affine-attention report RUN_DIR`)")
    c.add_argument("--tasks", default=None, help="zero-shot tasks for every final checkpoint (lm-eval names, "
                   "comma-separated; 'paper' = the paper's six, which need the Hub or a datasets cache); they join "
                   "Table 1 and the Claims table. Offline fixture tasks are refused: they are not accuracies")
    c.add_argument("--include-path", action="append", default=None, metavar="DIR",
                   help="folder of your own lm-eval task YAMLs for --tasks (repeatable)")
    c.add_argument("--tasks-limit", type=float, default=None, metavar="N",
                   help="at most N documents per task (a smoke test: not comparable with published numbers)")
    c.set_defaults(func=_compare)


def _compare(args) -> int:
    from .train.cli import dry_run, run_compare

    if args.dry_run:
        return dry_run(args, compare=True)

    if args.tasks:
        from .eval.runs import check_tasks

        # Before any training: a typo or a fixture task must not cost the whole run.
        check_tasks(args.tasks, args.include_path)
    after = None
    if args.report:
        from .analysis.report import estimate

        after = estimate  # the progress lines' time left includes the report that follows training
    out, main = run_compare(args, after)
    if main and args.tasks:
        from .eval.runs import evaluate_run

        limit = args.tasks_limit
        evaluate_run(out, args.tasks, include_path=args.include_path,
                     limit=int(limit) if limit is not None and limit >= 1 else limit,
                     log=lambda m: print(m, file=sys.stderr, flush=True))
    if main:
        if args.report:
            try:
                from .analysis.report import write_report
            except ModuleNotFoundError as err:
                raise ValueError(f"writing the report needs {err.name} (pip install 'affine-attention[analysis]'); "
                                 "or pass --no-report and run `affine-attention report RUN_DIR` later") from err
            from .analysis.report_claims import run_claims_text

            paths = write_report(out)
            claims = run_claims_text(out)
            if claims:
                print(claims)
            print(f"report: {paths['html']} (and {paths['md']})")
        print(f"run folder: {out}")
    return 0


def _add_backends(sub) -> None:
    """`backends` reads the variant registry (which variants ask for an lse), above ops/plan.py, which plans."""
    c = sub.add_parser("backends", help="which attention kernel serves each mask kind, and why the others refuse")
    c.add_argument("--device", default="cuda",
                   help="device type to plan for: cpu or cuda (cuda:0 plans for cuda; no such device needed)")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"],
                   help="dtype of the planned calls")
    c.add_argument("--compiled", nargs="?", const="blocks", choices=["blocks", "model"],
                   help="as under torch.compile: of each decoder block (default; the mask read eagerly) or of the "
                        "whole model (mask values unreadable)")
    c.set_defaults(func=_backends)


def _backends(args) -> int:
    import torch

    from .ops.plan import MODES, device_type_of, dispatch_table, markdown
    from .variants import REGISTRY

    names = {lse: ", ".join(n for n, v in REGISTRY.items() if v.needs_lse == lse) for lse in (False, True)}
    mode = args.compiled or "eager"
    device = device_type_of(args.device)
    rows = dispatch_table(device, getattr(torch, args.dtype), mode)
    print(f"{device} {args.dtype}, {MODES[mode]} (training call, D = 128):\n")
    print(markdown(rows, names[False], names[True]))
    return 0


OVERVIEW = """\
Affine-Scaled Attention (Bae et al., ICML 2026): train, compare, evaluate and inspect attention variants
(softmax, affine, sink, gated, ...) on transformers causal LMs. Offline by default: the tiny presets, the packaged
corpus and SmolLM2-135M need no download.
"""

EXAMPLES = """\
examples (one per command; `affine-attention COMMAND --help` for its options):
  affine-attention train --config tiny --set variant.name=affine --out runs/affine
  affine-attention export --run runs/affine --step 100 --out runs/affine-step100
  affine-attention prepare-data --config paper-1b --out data/fineweb-edu-1b   (then data.train.kind = "tokens")
  affine-attention compare --config tiny-ablation --out runs/ablation
  affine-attention report runs/ablation
  affine-attention params --preset llama-3.2-1b --variant affine
  affine-attention families
  affine-attention backends --device cuda --dtype bfloat16 --compiled
  affine-attention eval --model runs/affine/final --tasks fixtures --ppl heldout.txt
  affine-attention analyze --model smollm2 --sequences 2 --length 256 --out runs/analysis
  affine-attention vllm-cpu-alias   (once, after installing vllm-cpu: docs/serving.md)
"""


def _version() -> str:
    from ._version import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="affine-attention", description=OVERVIEW, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in AREAS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:  # a real missing dependency inside the area: say so
                raise
            continue
        module.add_commands(sub)
        if name == "affine_attention.train.cli":
            _add_compare(sub)
    _add_backends(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ValueError as err:  # bad input: one clear line, not a traceback
        print(f"affine-attention {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
