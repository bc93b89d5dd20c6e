"""The one prepared script for a lent GPU machine: the library's attention against raw flash, the CUDA tests, a
converted 1B-class Llama eager and compiled, flex, long-context masks -- most important first, in at most ~520 s.

On the lent machine (one H100/H200, Python 3.12, torch 2.11, no network), from the repository root, no install step
(it runs from the source tree; with the device tool: timeout_s ~560, $OUT the folder whose files come back):

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_session.py --out $OUT/gpu_session.md

CPU dry run (CI; every stage's code on tiny sizes, under 2 minutes; CUDA-only cells say "not run (no CUDA)"):

    python3 benchmarks/gpu_session.py --device cpu --quick

Stages, in order (S1, S3, S4, S5 measure in fresh worker processes: benchmarks/gpu_check_worker.py):
  S1 bf16, D = 128, Hq/Hkv = 32/8, causal, T = 4096 and 16384: raw SDPA-flash (SDPA restricted to FLASH) = 1.00,
     then softmax, sink, affine (automatic backend, and forced cuda_flash), and softmax with the non-finite rule
     switched off (its cost: softmax on vs off vs raw), forward and forward+backward (CUDA events), TFLOP/s, peak
     memory, float64 error on a slice; one right-padded T = 4096 block against raw varlen FA2.
  S2 the `cuda`-marked tests outside the flex file (cuda_flash, the epilogue) under a hard timeout, then the Triton
     epilogue against the eager one.
  S3 Llama-3.2-1B's shape with random weights, B = 4, T = 2048: unconverted / affine / sink eager, then each with
     its decoder blocks compiled: step time, tokens/s, MFU, peak memory; compiled loss and gradient norms (q_proj,
     v_proj, alpha_proj) against eager on one batch (a zero or diverging one is a FAIL in the row).
  S4 flex forced at T = 4096 (softmax, sink) against S1's raw baseline, with compile seconds; four flex CUDA tests.
  S5 T = 16384 padded / documents / window (gpu_check's configuration groups), if time is left.

One clock for the whole run (--deadline-s): a stage starts only if its minimum fits, each is cut at the deadline,
and the script ends by itself. Every row is in the report as soon as it is known (rewritten atomically); the first
line names the device and versions. Tracebacks: <out>.tracebacks.txt, test output <out>.<stage>.pytest.txt, worker
output <out>.workers/, events <out>.log. Exit 0 whatever the measurements do (2 without the asked-for CUDA device).

benchmarks/gpu_check.py stays the wider sweep (every T x heads x mask, model families), run in parts with --only.
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [p for p in (HERE, ROOT) if p not in sys.path]  # no install step: the source tree
from affine_attention._files import atomic_write_text  # noqa: E402  (no torch at import)
from gpu_check import COLUMNS as CONFIG_COLUMNS, NUM_COLUMNS  # noqa: E402  (stdlib only at import)
from gpu_check_worker import (  # noqa: E402
    JOBS, STARTUP_S, Log, Tracebacks, Worker, outcome_words, run_cuda_tests, run_group, supervised, worker_main,
)
from gpu_session_stages import KERNEL_COLUMNS, LLAMA_COLUMNS, flex_rows, kernel_rows, llama_rows  # noqa: E402

SESSION_JOBS = dict(JOBS, kernels=kernel_rows, llama=llama_rows, flex=flex_rows)
# table -> (stage, title, columns, the cell a failure's text goes into)
TABLES = {
    "kernels": ("S1", "attention ops against raw flash (ratios: time / the block's raw row)", KERNEL_COLUMNS,
                "backend"),
    "numerics": ("S2", "Triton epilogue against the eager one (max abs / max rel of triton - eager)", NUM_COLUMNS,
                 "out"),
    "llama": ("S3", "converted 1B-class Llama, training step (loss forward + backward)", LLAMA_COLUMNS, "backends"),
    "flex": ("S4", "flex forced (ratios: time / S1's raw SDPA-flash at the same T)", KERNEL_COLUMNS, "backend"),
    "main": ("S5", "long-context masks (ratios: time / the same kernel's softmax)", CONFIG_COLUMNS, "backend"),
}
STAGES = {"S1": "kernels", "S2": "CUDA tests", "S3": "1B Llama", "S4": "flex", "S5": "long-context masks"}
# The flex CUDA tests chosen by node id (each resets dynamo and compiles; the whole file does not fit).
FLEX_TESTS = [f"tests/test_backends_flex.py::test_cuda_flex_against_float64_reference[{case}]"
              for case in ("sink-softcap", "affine-documents_pad", "sink-holes_pad", "affine-decode_pad")]


def cuda_test_files() -> list[str]:
    """The test files that mark tests `cuda`, less the flex file (S4 picks four of its tests)."""
    marked = re.compile(r"^\s*(@pytest\.mark\.cuda\b|pytestmark\s*=.*\bmark\.cuda\b)", re.M)
    tests = os.path.join(ROOT, "tests")
    return sorted(f"tests/{f}" for f in os.listdir(tests) if f.startswith("test_") and f.endswith(".py")
                  and f != "test_backends_flex.py" and marked.search(open(os.path.join(tests, f)).read()))


def plan(args) -> list[dict]:
    """Every job in run order, with its time limit and the least time worth starting it with (GPU seconds; the
    clock's deadline caps both)."""
    t_main, t_long = args.lengths
    jobs = [dict(kind="kernels", id=f"S1-T{T}-{mask}", stage="S1", T=T, mask=mask, limit=90, least=20,
                 key={"T": str(T), "mask": mask, "row": "all"})
            for T, mask in ((t_main, "causal"), (t_long, "causal"), (t_main, "padded"))]
    jobs += [dict(kind="pytest", id="S2-cuda-tests", stage="S2", paths=cuda_test_files(), limit=100, least=30),
             dict(kind="numerics", id="S2-epilogue-numerics", stage="S2", limit=60, least=15, key={"dtype": "all"}),
             dict(kind="llama", id="S3-llama", stage="S3", limit=300, least=90, key={"variant": "all"}),
             dict(kind="flex", id="S4-flex", stage="S4", T=t_main, limit=120, least=45,
                  key={"T": str(t_main), "row": "all"}),
             dict(kind="pytest", id="S4-flex-tests", stage="S4", paths=FLEX_TESTS, limit=150, least=40)]
    (Hq, Hkv), tokens = args.heads[0], args.tokens
    jobs += [dict(kind="config", id=f"S5-T{t_long}-{mask}", stage="S5", T=t_long, Hq=Hq, Hkv=Hkv, mask=mask,
                  limit=90, least=30, key={"T": str(t_long), "B": str(max(1, tokens // t_long)),
                                           "Hq/Hkv": f"{Hq}/{Hkv}", "mask": mask, "variant": "all"})
             for mask in ("padded", "documents", "window")]
    for j in jobs:
        j["table"] = {"pytest": None, "config": "main"}.get(j["kind"], j["kind"])
    return [j for j in jobs if not args.only or any(fnmatch.fnmatchcase(j[f], p) for p in args.only
                                                    for f in ("id", "stage"))]


class Report:
    """The markdown report: the environment in its first line, one section per stage (its notes and tables), rewritten
    whole and atomically after every change, so the file is always a complete document of what is known."""

    def __init__(self, path: str):
        self.path, self.env, self.status, self.ending = path, "environment not known yet", "", []
        self.notes = {s: [] for s in STAGES}
        self.rows = {t: [] for t in TABLES}

    def add(self, table: str, cells: dict) -> str:
        row = [str(cells.get(c, "—")).replace("|", "/").replace("\n", " ") for c in TABLES[table][2]]
        self.rows[table].append(row)
        self.write()
        return f"{TABLES[table][0]} | " + " | ".join(row) + " |"

    def note(self, stage: str, text: str) -> str:
        self.notes[stage].append(text)
        self.write()
        return f"{stage}: {text}"

    def render(self) -> str:
        out = [f"# gpu_session: {self.env}", ""]
        for stage, name in STAGES.items():
            out += [f"## {stage} {name}", ""] + [n + "\n" for n in self.notes[stage]]
            for table, (s, title, cols, _) in TABLES.items():
                if s == stage and (self.rows[table] or not self.notes[stage]):
                    out += [f"{title}:", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                    out += ["| " + " | ".join(r) + " |" for r in self.rows[table]] + [""]
        return "\n".join(out + [n + "\n" for n in self.ending] + [self.status, ""])

    def write(self) -> None:
        atomic_write_text(self.path, self.render())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="tiny sizes (the CPU dry run)")
    p.add_argument("--out", default=None, help="the report (markdown); default: gpu_session.md in a new temp folder")
    p.add_argument("--deadline-s", type=float, default=520.0, help="the run's clock: it ends by itself by then")
    p.add_argument("--only", nargs="*", default=None, help="stages (S1..S5) or job ids (fnmatch patterns) to run")
    p.add_argument("--inject-failure", action="append", default=[], help=argparse.SUPPRESS)  # tests only
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one group
    p.add_argument("--worker-versions", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.deadline_s <= 0:
        p.error(f"--deadline-s {a.deadline_s:g}: give the run's length in seconds (> 0), e.g. 520")
    a.heads, a.window, a.warmup = [(32, 8)], 4096, 2
    a.lengths, a.head_dim, a.tokens, a.repeats, a.model_repeats = (4096, 16384), 128, 16384, 7, 3
    a.error_rows, a.error_max_t, a.numerics_t = 128, 1088, 4096
    if a.quick:  # the same code on sizes a shared CPU runs in seconds
        a.heads, a.window, a.warmup = [(4, 2)], 32, 1
        a.lengths, a.head_dim, a.tokens, a.repeats, a.model_repeats = (64, 128), 32, 256, 1, 1
        a.error_rows, a.error_max_t, a.numerics_t = 32, 128, 64
    return a


def run(args, report: Report, log: Log, tracebacks: Tracebacks, start: float, live: list) -> int:
    """Each job of plan() in order while the clock allows, a worker for the next one starting while the current one
    runs; every outcome into the report as it comes."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    os.makedirs(args.out + ".workers", exist_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device] + ["--quick"] * args.quick
    cmd += [f"--inject-failure={s}" for s in args.inject_failure]
    deadline = start + args.deadline_s

    def spawn(first=False):
        live.append(Worker(cmd + ["--worker-versions"] * first, args.out + ".workers", env))
        return live[-1]

    jobs = plan(args)
    first = spawn(first=True)  # its ready record carries the versions for the first line
    ready = first.wait_ready(time.monotonic() + STARTUP_S)
    report.env = (ready or {}).get("versions") or (f"environment unknown (the first worker did not get ready; see "
                                                   f"{os.path.basename(args.out)}.workers/{first.name}.out)")
    report.write()
    log(f"environment: {report.env}")
    if ready and args.device == "cuda" and not ready["cuda"]:
        report.ending.append("no CUDA device: run with --device cpu --quick for the dry run")
        print(report.ending[-1], file=sys.stderr)
        return 2
    spare, raw = first, {}  # spare: a started worker waiting for a job; raw: S1's raw SDPA-flash times by T
    workers = [j for j in jobs if j["kind"] != "pytest"]
    for job in jobs:
        left = deadline - time.monotonic()
        if left < job["least"] * (0.1 if args.quick else 1):
            log(report.note(job["stage"], f"skipped {job['id']}: {max(left, 0):.0f} s left on the clock, it needs "
                                          f"at least {job['least']} s"))
            continue
        report.status = f"_in progress: {job['id']} since {time.monotonic() - start:.0f} s; a report that ends here " \
                        f"was cut short_"
        report.write()
        if job["kind"] == "pytest":
            if spare is None and job is not jobs[-1]:
                spare = spawn()  # imports torch while the tests run
            out = f"{args.out}.{job['id']}.pytest.txt"
            log(report.note(job["stage"], run_cuda_tests(job["paths"], out, min(job["limit"], left), env)))
            continue
        if job["kind"] == "flex":
            job["raw"] = raw.get(job["T"])
        w, spare = spare or spawn(), None
        if job is not workers[-1]:
            spare = spawn()
        got = {"rows": 0}

        def handle(rec, job=job, got=got):
            if "row" in rec:
                got["rows"] += 1
                row = rec["row"]
                if rec["table"] == "kernels" and row.get("row") == "raw SDPA-flash":
                    raw[int(row["T"])] = {k: row.get(k) for k in ("fwd ms", "fwd+bwd ms")}
                log(report.add(rec["table"], row))
            elif "failed" in rec:
                f = rec["failed"]
                short = f"{f['type']}: {f['message']}".replace("\n", " ")[:160]
                ref = tracebacks.add(f"{job['id']} {f['key']}", f["traceback"])
                log(report.add(f["table"], dict(f["key"], **{TABLES[f["table"]][3]: f"failed: {short} ({ref})"})))
            elif "fatal" in rec:
                log(report.add(job["table"], dict(job["key"], **{TABLES[job["table"]][3]: rec["fatal"]})))
            elif "note" in rec:
                log(f"{job['id']}: {rec['note']}", echo=False)

        outcome, secs = run_group(w, job, job["limit"], deadline, handle)
        live.remove(w)
        log(f"{job['id']}: {outcome} after {secs:.1f} s ({got['rows']} rows)", echo=False)
        if outcome != "done":
            what = outcome_words(outcome, secs)
            ref = tracebacks.add(f"{job['id']}: {what}", w.evidence())
            log(report.add(job["table"], dict(job["key"], **{TABLES[job["table"]][3]: f"failed: {what} ({ref})"})))
    if spare is not None:
        spare.dismiss()
        live.remove(spare)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args, SESSION_JOBS)
    args.out = os.path.abspath(args.out or os.path.join(tempfile.mkdtemp(prefix="gpu_session_"), "gpu_session.md"))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    report = Report(args.out)
    return supervised("gpu_session", args.out, report, report.ending.append,
                      lambda log, tracebacks, start, live: run(args, report, log, tracebacks, start, live))


if __name__ == "__main__":
    sys.exit(main())
