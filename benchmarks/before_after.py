"""Run one benchmark of this folder on two checkouts of the project, alternating them round by round, so that a change
is measured against the code before it on the same machine in the same run (drift hits both sides alike).

    git worktree add /tmp/before <revision>
    python benchmarks/before_after.py --before /tmp/before --rounds 3 -- bench_decode.py --lengths 256 1024 --threads 1

Each round runs the benchmark once per checkout (the order alternates between rounds) with that checkout's own
benchmarks/ script and package; the outputs are printed in turn, labelled, and written under --out when given. Every
benchmark here prints ratios against a baseline of its own run ("1.23x" cells of its markdown tables); the summary
at the end gives, per table cell, the median over rounds on each side and after / before.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


_VALUE = re.compile(r"^([0-9.]+)x\b|^\+(-?[0-9.]+)$")  # "1.23x" (a ratio) or "+184.6" (an extra time)


def ratio_cells(text: str) -> dict[tuple[str, str], float]:
    """{(row label, column header): value} for every ratio cell ("1.23x ...") and extra-time cell ("+184.6") of the
    markdown tables in a benchmark's output. The row label is the row's cells before its first such cell, less the
    absolute times (columns whose header names ms or µs), which differ between processes."""
    cells, header = {}, None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None or set("".join(parts)) <= set("-: "):
            header = header or parts
            continue
        if len(parts) != len(header):
            continue
        found = [(i, _VALUE.match(c)) for i, c in enumerate(parts)]
        first = next((i for i, m in found if m), None)
        if first is None:
            continue
        label = " ".join(c for c, h in zip(parts[:first], header[:first]) if "ms" not in h and "µs" not in h)
        for i, m in found[first:]:
            if m:
                cells[(label, header[i])] = float(m.group(1) or m.group(2))
    return cells


def summary(outputs: dict[str, list[str]]) -> str:
    """Per cell: median of each side's values over the rounds, then after / before."""
    per = {side: [ratio_cells(t) for t in texts] for side, texts in outputs.items()}
    keys = sorted(set().union(*(c.keys() for c in per["before"])) & set().union(*(c.keys() for c in per["after"])))
    lines = ["| row | column | before | after | after / before |", "|---|---|---:|---:|---:|"]
    for key in keys:
        med = {side: statistics.median(c[key] for c in per[side] if key in c) for side in per}
        lines.append(f"| {key[0]} | {key[1]} | {med['before']:.3f} | {med['after']:.3f} | "
                     f"{med['after'] / med['before']:.3f} |")
    return "\n".join(lines)


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
    outputs: dict[str, list[str]] = {side: [] for side in sides}
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
            outputs[side].append(run.stdout)
    print(f"===== medians over {args.rounds} rounds of the ratio cells =====\n{summary(outputs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
