"""Run one benchmark of this folder on two checkouts of the project, alternating them round by round, so that a change
is measured against the code before it on the same machine in the same run (drift hits both sides alike).

    git worktree add /tmp/before <revision>
    python benchmarks/before_after.py --before /tmp/before --rounds 3 -- bench_decode.py --lengths 256 1024 --threads 1

Each round runs the benchmark once per checkout (the order alternates between rounds) with that checkout's own
benchmarks/ script and package; the outputs are printed in turn, labelled, and written under --out when given. Every
benchmark here prints ratios against a baseline of its own run, so compare those ratios across the two sides.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, type=Path, help="a checkout of the revision to compare against")
    p.add_argument("--after", type=Path, default=HERE, help="the changed checkout (default: this one)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running both sides once (default 3)")
    p.add_argument("--out", type=Path, help="folder for the outputs: <side>-<round>.txt")
    p.add_argument("benchmark", nargs=argparse.REMAINDER, help="-- then the script name in benchmarks/ and its args")
    args = p.parse_args(argv)
    bench = [a for a in args.benchmark if a != "--"]
    if not bench or not bench[0].endswith(".py"):
        p.error("name the benchmark after --, e.g. -- bench_decode.py --quick")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    for side, root in sides.items():
        if not (root / "benchmarks" / bench[0]).is_file():
            p.error(f"{side}: {root / 'benchmarks' / bench[0]} does not exist")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    order = list(sides)
    for r in range(args.rounds):
        for side in (order if r % 2 == 0 else order[::-1]):
            root = sides[side]
            # That side's checkout first on the path, before an installed (editable) copy of the package.
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
            run = subprocess.run([sys.executable, str(root / "benchmarks" / bench[0]), *bench[1:]], cwd=root,
                                 env=env, capture_output=True, text=True)
            text = run.stdout + (f"\n[stderr]\n{run.stderr}" if run.returncode else "")
            print(f"===== {side} ({root}), round {r + 1} of {args.rounds}, rc {run.returncode} =====\n{text}",
                  flush=True)
            if args.out:
                (args.out / f"{side}-{r + 1}.txt").write_text(text)
            if run.returncode:
                return run.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
