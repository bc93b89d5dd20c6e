"""`affine-attention analyze` and `affine-attention report`: argument parsing only (heavy imports inside handlers)."""
from __future__ import annotations

import argparse


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def add_commands(sub) -> None:
    """Add the `analyze` and `report` subcommands to an argparse subparsers object."""
    p = sub.add_parser(
        "analyze", help="attention diagnostics of a causal LM: metrics.json and figures",
        description="Record attention of a local transformers causal LM (converted or not), a .gguf file or "
                    "the packaged SmolLM2-135M ('smollm2') on held-out text; write metrics.json (per layer and "
                    "head: first-token mass, entropy, total mass, utilisation, alpha, sink mass, QK logit) and "
                    "PNG figures. A checkpoint of `train` / `compare` is analysed on its run's own held-out text "
                    "at its trained length (a run on data analyze cannot read again is refused).")
    p.add_argument("--model", required=True, help="model folder, path to a .gguf file, or 'smollm2'")
    p.add_argument("--data", default=None,
                   help=".txt (one document) or .jsonl ({'text': ...} per line); default: packaged validation corpus")
    p.add_argument("--sequences", type=_positive, default=10, help="number of token windows (default 10)")
    p.add_argument("--length", type=_positive, default=None,
                   help="tokens per window (default: a run checkpoint's trained length, else 1024)")
    p.add_argument("--out", default=None, help="output folder (default runs/analyze-<time>)")
    p.add_argument("--chunk", type=_positive, default=256,
                   help="queries per block when recomputing weights: bounds memory (default 256)")
    p.add_argument("--layer", type=int, default=None, help="layer position for the attention map (default middle)")
    p.add_argument("--batch-size", type=_positive, default=1, help="sequences per forward (default 1)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default auto)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or .gguf when the model folder has none")
    p.add_argument("--prefix", default="", help="prefix for figure file names, e.g. 'smollm2-'")
    p.set_defaults(func=_run_analyze)

    r = sub.add_parser(
        "report", help="write report.md and report.html for a compare run directory",
        description="Regenerate report.md and a self-contained report.html from a `compare` run directory: "
                    "saved metrics and final checkpoints are read, nothing is retrained.")
    r.add_argument("run_dir", help="the run directory written by `affine-attention compare`")
    r.add_argument("--sequences", type=_positive, default=4,
                   help="held-out sequences for the attention diagnostics of each final checkpoint (default 4)")
    r.add_argument("--length", type=int, default=0, help="tokens per sequence (default: the run's seq_len)")
    r.add_argument("--no-attention", action="store_true", help="skip the checkpoint attention diagnostics")
    r.add_argument("--window", type=int, default=500, help="gradient statistics over steps [0, WINDOW) (default 500)")
    r.set_defaults(func=_run_report)


def _steady_allocator() -> None:
    """Fix glibc's mmap threshold at 4 MiB for this process (Linux only; a no-op elsewhere).

    Why: glibc raises the threshold dynamically after freeing large blocks, after which the recorder's multi-MB
    attention blocks are served from the heap and kept there once freed; the peak RSS then overstates the memory
    actually in use by about 1 GB on SmolLM2 at 1024 tokens, at no speed gain (measured: same wall time).
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc (e.g. musl): nothing to tune


def _run_analyze(args) -> int:
    from .analyze import analyze

    _steady_allocator()

    analyze(args.model, data=args.data, sequences=args.sequences, length=args.length, out=args.out,
            chunk=args.chunk, layer=args.layer, batch_size=args.batch_size, device=args.device,
            tokenizer=args.tokenizer, prefix=args.prefix)
    return 0


def _run_report(args) -> int:
    from .report import write_report

    _steady_allocator()

    from .report_claims import run_claims_text

    paths = write_report(args.run_dir, sequences=args.sequences, length=args.length or None,
                         attention=not args.no_attention, window=(0, args.window))
    claims = run_claims_text(args.run_dir)
    if claims:
        print(claims)
    for p in paths.values():
        print(p)
    return 0
