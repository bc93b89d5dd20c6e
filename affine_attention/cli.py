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
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="affine-attention", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in AREAS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:  # a real missing dependency inside the area: say so
                raise
            continue
        module.add_commands(sub)
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
