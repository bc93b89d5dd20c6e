"""`affine-attention eval`: zero-shot tasks and/or perplexity for a local transformers model directory; with
--write-tasks, the fixture tasks written out for lm-eval's own command."""

from __future__ import annotations

import argparse
import sys


def _limit(text: str) -> int | float:
    # lm-eval's meaning: an integer is a document count, a fraction below 1 a share of each task.
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0 or (value >= 1 and not value.is_integer()):
        raise argparse.ArgumentTypeError("expected a positive integer count or a fraction below 1")
    return int(value) if value >= 1 else value


PPL_SEQ_LEN = 1024  # the perplexity window when --seq-len is not given and the model allows it


def ppl_seq_len(given: int | None, max_positions: int | None) -> int:
    """--seq-len, or without it PPL_SEQ_LEN capped at the model's max_position_embeddings (a default compare
    checkpoint has 32): an example that names no window must run on any checkpoint this package trains."""
    if given is not None:
        return given
    return min(PPL_SEQ_LEN, max_positions) if max_positions else PPL_SEQ_LEN


def _check_tokenizer_given(args) -> None:
    """A model folder saved without a tokenizer needs --tokenizer: say so before the model loads."""
    from pathlib import Path

    from ..hf.load import TOKENIZER_FILES  # inside: this module imports nothing heavy (the CLI's startup)

    folder = Path(args.model)
    if args.tokenizer is None and (folder / "config.json").is_file() and \
            not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"the model folder {args.model} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                         "pass --tokenizer DIR, e.g. the folder of the model it was trained or converted from, or "
                         "--tokenizer default for the packaged 4096-token tokenizer the tiny presets train with")


def add_commands(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="zero-shot tasks (lm-evaluation-harness) and perplexity for a local model",
        description=(
            "Evaluate a local transformers causal LM directory (converted affine/sink/... checkpoints "
            "included) with lm-evaluation-harness and/or token-level perplexity. Offline, use "
            "--tasks fixtures: lm-eval's real task definitions on small hand-written fixture files "
            "(a pipeline check, not a benchmark)."
        ),
    )
    parser.add_argument("--model", help="local model directory (config.json + weights), a .gguf file or smollm2")
    parser.add_argument("--tokenizer", help="local tokenizer directory, .gguf file, or 'default' (the packaged "
                        "tokenizer of the tiny presets); default: the model's own")
    parser.add_argument(
        "--tasks",
        help="comma-separated lm-eval task names; 'fixtures' = all offline fixture tasks, "
        "'paper' = winogrande,piqa,hellaswag,arc_challenge,arc_easy,boolq (need the Hub or a datasets cache)",
    )
    parser.add_argument(
        "--include-path", action="append", default=None, metavar="DIR",
        help="folder of your own task YAMLs (repeatable)",
    )
    parser.add_argument("--ppl", metavar="FILE", help="token-level perplexity on a .txt or .jsonl ('text' field) file")
    parser.add_argument("--seq-len", type=int, default=None, help=f"perplexity window length (default {PPL_SEQ_LEN}, "
                        "or the model's max_position_embeddings when that is shorter)")
    parser.add_argument("--stride", type=int, help="perplexity sliding-window step (default: --seq-len, no overlap)")
    parser.add_argument("--limit", type=_limit, help="at most N documents per task (testing only)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="sequences per forward pass, for the tasks and for --ppl (default 8)")
    parser.add_argument("--device", help="e.g. cpu, cuda, cuda:1 (default: where the model loads)")
    parser.add_argument(
        "--offline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="forbid dataset downloads (default: follow HF_DATASETS_OFFLINE / HF_HUB_OFFLINE)",
    )
    parser.add_argument("--out", metavar="DIR", help="write results.json and results.md here")
    parser.add_argument("--write-tasks", metavar="DIR", help="only write the fixture tasks into DIR (a new or empty "
                        "folder) as task files lm-eval's own command reads: lm_eval --include_path DIR ...")
    parser.set_defaults(func=_run)


def _write_tasks(folder: str) -> int:
    """`--write-tasks DIR`: the fixture tasks with their paths filled in (the shipped YAMLs are templates)."""
    from pathlib import Path

    from .tasks import FIXTURE_TASKS, materialize_fixture_tasks

    out = Path(folder)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--write-tasks {folder}: {'is not empty' if out.is_dir() else 'is a file'}; "
                         "give a new or empty folder (nothing there is replaced)")
    out = materialize_fixture_tasks(out)
    print(f"wrote the fixture tasks ({', '.join(FIXTURE_TASKS)}) to {out}; run them with lm-eval's command:\n"
          f"  lm_eval --model hf --model_args pretrained=MODEL_DIR,trust_remote_code=True --include_path {out} "
          "--tasks fixture_piqa")
    return 0


def _run(args) -> int:
    from pathlib import Path

    if args.write_tasks:
        if args.model or args.tasks or args.ppl:
            raise ValueError("--write-tasks only writes task files: run it without --model, --tasks and --ppl")
        return _write_tasks(args.write_tasks)
    if not args.model:
        raise ValueError("--model is required: a local model directory, a .gguf file or smollm2 "
                         "(or --write-tasks DIR to only write the fixture tasks for lm-eval's own command)")
    if not args.tasks and not args.ppl:
        raise ValueError("nothing to do: give --tasks (e.g. --tasks fixtures) and/or --ppl FILE")
    if args.ppl and not Path(args.ppl).is_file():
        raise ValueError(f"--ppl file {args.ppl!r} does not exist")

    # Heavy imports here, not at module level: the command line imports every area's cli module.
    from .._progress import phase
    from ..hf.load import load_model, load_tokenizer
    from .harness import evaluate
    from .results import format_table, write_results
    from .tasks import check_tasks
    from .perplexity import perplexity

    # What can fail fast does so before the slow model load: task names, a missing tokenizer.
    tasks = check_tasks(args.tasks, args.include_path) if args.tasks else []
    _check_tokenizer_given(args)
    with phase(f"loading model {args.model}"):
        model = load_model(args.model, device=args.device)
    tokenizer = load_tokenizer(args.tokenizer or args.model)

    if tasks:
        results = evaluate(
            model,
            tokenizer,
            tasks,
            offline=args.offline,
            batch_size=args.batch_size,
            limit=args.limit,
            include_path=args.include_path,
        )
    else:
        results = {"tasks": {}, "config": {}}
    results["config"]["model"] = args.model
    if args.ppl:
        seq_len = ppl_seq_len(args.seq_len, getattr(model.config, "max_position_embeddings", None))
        if seq_len != (args.seq_len or PPL_SEQ_LEN):
            print(f"--ppl: windows of {seq_len} tokens, the model's max_position_embeddings (--seq-len sets another)",
                  file=sys.stderr)
        ppl = perplexity(
            model, tokenizer, args.ppl, seq_len=seq_len, stride=args.stride, batch_size=args.batch_size
        )
        results["perplexity"] = {"source": str(args.ppl), **ppl}

    print(format_table(results), end="")
    if args.out:
        json_path, md_path = write_results(results, args.out)
        print(f"wrote {json_path} and {md_path}")
    return 0
