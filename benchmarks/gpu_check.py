"""The wider GPU sweep (benchmarks/gpu_session.py is the one prepared script for a lent machine): install, the CUDA
tests, then one markdown table of the attention kernels (time ratios to the same kernel's plain softmax, peak memory,
bf16-vs-float64 errors, which SDPA kernel ran) and a small table of the Triton epilogue against the eager one.

Its whole schedule does not fit one ~9-minute loan: the flex CUDA tests reset dynamo before each test (more than the
test stage's 210 s), the T = 16384 groups come last, and the model groups and the epilogue timing group fall past
the 420 s budget. Run it in parts with --only (and --tests for the test files) on a longer loan.

On the lent machine (one H200, Python 3.12, torch 2.11, no network), from the repository root:

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --install --out $OUT/gpu_check.md --only "T1024-*"  # one part

(with the device tool: that command, timeout_s 540; $OUT is the folder whose files come back).

CPU dry run (CI; the same code paths on tiny sizes, well under a minute):

    python3 benchmarks/gpu_check.py --device cpu --quick

It never loses a run: every subprocess has a timeout (pip, pytest, each group); the report is rewritten atomically
after every row (a kill keeps each finished row, and its last line names the group that was running); each
configuration group runs in a fresh Python process (benchmarks/gpu_check_worker.py), so a sticky CUDA error, a crash
or a hang costs that group only, recorded as a `failed: ...` row; full tracebacks and stack dumps go to
<out>.tracebacks.txt, the CUDA tests' output to <out>.pytest.txt, each group's output to <out>.workers/, events to
<out>.log. It exits 0 whatever the measurements do (1 only if this script itself fails, 2 without the asked-for
CUDA device) and prints the report's path last.

Rows: bf16, D = 128, T in {1024, 1088, 4096, 16384} (1088 = 8.5 x 128: a partial last kernel block), B = 16384 // T,
Hq/Hkv in {32/8, 16/16}, masks causal / padded (right padding of 1/8..4/8 of each row) / 8 documents per row /
window 4096 (equal to causal while T <= 4096). Every variant is forced onto one kernel backend (cuda_flash on a GPU)
and timed against that backend's plain softmax on the same inputs; "softmax (auto)" is the automatic choice (SDPA)
on the same call. "backend" is the dispatcher's choice; "sdpa kernel" what SDPA ran (profiled) on rows the sdpa
backend serves. Errors: max |bf16 - float64| / max |float64| over the first two batch rows, at T <= 1088 only
(the float64 reference materialises T x T weights). Epilogue table: B = 4, Hq/Hkv = 32/8, T = 4096.
Model table (benchmarks/gpu_check_models.py; groups model-<family>-<eager|compiled>; on the CPU dry run only when
named with --only; on a GPU a second run with `--only 'model-*'` gives them the whole budget): training steps of
converted Gemma 2 (softcap) and Mistral (window) with right padding and Llama on packed documents, eager and
compiled (fullgraph), per variant against the unconverted model run the same way, the backends that served them,
and the FA3 switch as an extra column.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from gpu_check_models import CASES as MODEL_CASES, MODEL_COLUMNS  # noqa: E402  (stdlib only at import time)
from gpu_check_models import model_rows  # noqa: E402
from gpu_check_worker import (  # noqa: E402
    JOBS, STARTUP_S, Log, Tracebacks, Worker, install, outcome_words, run_cuda_tests, run_group, supervised,
    worker_main,
)

COLUMNS = ["T", "B", "Hq/Hkv", "mask", "variant", "backend", "sdpa kernel", "fwd ms", "fwd / softmax", "fwd+bwd ms",
           "fwd+bwd / softmax", "peak MiB fwd+bwd", "err out", "err dq", "err dk", "err dv", "err dsinks/dalpha"]
NUM_COLUMNS = ["dtype", "gate", "B, Hq/Hkv, T, D", "out", "d out", "d alpha", "d alpha_ma", "d gate", "d v_mean",
               "rel eager vs float64", "rel triton vs float64"]
MASKS = ("causal", "padded", "documents", "window")


class Report:
    """The markdown report, rewritten whole and atomically (temp file + os.replace) after every change, so the
    file on disk is always a complete document with every row finished so far."""

    def __init__(self, path: str, order: list[str]):
        self.path, self.order = path, order
        self.env, self.steps, self.notes, self.status = "environment: not known yet", [], [], ""
        self.rows: dict[str, list[list[str]]] = {gid: [] for gid in order}
        self.numerics: list[list[str]] = []
        self.models: list[list[str]] = []

    def add(self, table: str, gid: str, cells: dict) -> str:
        cols = {"main": COLUMNS, "models": MODEL_COLUMNS}.get(table, NUM_COLUMNS)
        row = [str(cells.get(c, "—")).replace("|", "/").replace("\n", " ") for c in cols]
        (self.rows[gid] if table == "main" else self.models if table == "models" else self.numerics).append(row)
        self.write()
        return "| " + " | ".join(row) + " |"

    def render(self) -> str:
        out = ["# gpu_check", "", self.env, ""] + [s + "\n" for s in self.steps]
        out += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        out += ["| " + " | ".join(r) + " |" for gid in self.order for r in self.rows[gid]]
        if self.numerics:
            out += ["", "Triton epilogue vs eager, forward and backward (per tensor: max abs / max rel of triton - "
                    "eager; the last two columns: max rel over the tensors against the float64 eager epilogue):", "",
                    "| " + " | ".join(NUM_COLUMNS) + " |", "|" + "---|" * len(NUM_COLUMNS)]
            out += ["| " + " | ".join(r) + " |" for r in self.numerics]
        if self.models:
            out += ["", "Training steps of converted models (loss forward + backward) against the unconverted model "
                    "run the same way (eager, or torch.compile with fullgraph); backends: what served their attention:",
                    "",
                    "| " + " | ".join(MODEL_COLUMNS) + " |", "|" + "---|" * len(MODEL_COLUMNS)]
            out += ["| " + " | ".join(r) + " |" for r in self.models]
        return "\n".join(out + [""] + self.notes + ["", self.status, ""])

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.write(self.render())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def plan(args) -> list[dict]:
    """The jobs in run order: the epilogue numerics (small, new), every (T, heads, mask) group, the epilogue
    timing rows; each with the key cells its failure row carries."""
    jobs = [{"kind": "numerics", "id": "epilogue-numerics", "table": "numerics", "key": {"dtype": "all"}}]
    for T in args.lengths:
        for Hq, Hkv in args.heads:
            for mask in MASKS:
                key = {"T": str(T), "B": str(max(1, args.tokens // T)), "Hq/Hkv": f"{Hq}/{Hkv}", "mask": mask,
                       "variant": "all"}
                jobs.append({"kind": "config", "id": f"T{T}-{Hq}x{Hkv}-{mask}", "table": "main", "key": key,
                             "T": T, "Hq": Hq, "Hkv": Hkv, "mask": mask})
    for family, case in MODEL_CASES if not args.quick or args.only else ():  # the dry run's only on --only (minutes)
        for mode in ("eager", "compiled"):
            jobs.append({"kind": "models", "id": f"model-{family}-{mode}", "table": "models", "family": family,
                         "case": case, "mode": mode, "key": {"model": family, "batch": case, "mode": mode}})
    T, (Hq, Hkv) = args.lengths[0], args.heads[0]
    jobs.append({"kind": "epilogue", "id": "epilogue", "table": "main", "T": T, "Hq": Hq, "Hkv": Hkv,
                 "key": {"T": str(T), "B": str(max(1, args.tokens // T)), "Hq/Hkv": f"{Hq}/{Hkv}", "mask": "causal",
                         "variant": "all"}})
    return [j for j in jobs if not args.only or any(fnmatch.fnmatchcase(j["id"], p) for p in args.only)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="tiny sizes (the CPU dry run)")
    p.add_argument("--install", action="store_true", help="pip install --no-deps -e . first")
    p.add_argument("--tests", nargs="*", default=None,
                   help="paths for `pytest -m cuda` (default: the test files that use the marker; an empty list "
                        "skips them)")
    p.add_argument("--tests-timeout-s", type=float, default=None, help="default: min(240, budget / 2)")
    p.add_argument("--out", default=None, help="the report (markdown); default: gpu_check.md in a new temp folder")
    p.add_argument("--only", nargs="*", default=None, help="run only the groups whose id matches one of these fnmatch "
                   "patterns (ids: epilogue-numerics, T1024-32x8-causal, ..., model-gemma2-compiled, epilogue)")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no group after this many seconds")
    p.add_argument("--deadline-s", type=float, default=500.0, help="kill a group still running at this time")
    p.add_argument("--group-timeout-s", type=float, default=150.0, help="kill a group running longer than this")
    p.add_argument("--inject-failure", action="append", default=[], help=argparse.SUPPRESS)  # tests only
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one group (see the worker)
    p.add_argument("--worker-versions", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.tests is None and not a.worker:  # the files that mark tests `cuda` (importing others needs packages not there)
        marked = re.compile(r"^\s*(@pytest\.mark\.cuda\b|pytestmark\s*=.*\bmark\.cuda\b)", re.M)
        a.tests = sorted(os.path.join("tests", f) for f in os.listdir(os.path.join(ROOT, "tests"))
                         if f.startswith("test_") and f.endswith(".py")
                         and marked.search(open(os.path.join(ROOT, "tests", f)).read()))
    if a.quick:
        a.lengths, a.heads, a.head_dim, a.tokens, a.window = [96], [(4, 2)], 128, 192, 32
        a.repeats, a.warmup, a.error_max_t, a.numerics_t = 1, 1, 96, 96
    else:
        a.lengths, a.heads, a.head_dim, a.tokens, a.window = [1024, 1088, 4096, 16384], [(32, 8), (16, 16)], 128, \
            16384, 4096
        a.repeats, a.warmup, a.error_max_t, a.numerics_t = 5, 2, 1088, 4096
    return a


def failure_cells(job: dict, label: str, text: str) -> dict:
    """The row that stands for a failed (part of a) group: its key, `label` as variant, `text` in the first cell."""
    if job["table"] == "main":
        return dict(job["key"], variant=label, backend=text)
    if job["table"] == "models":
        return dict(job["key"], variant=label, backends=text)
    return dict(job["key"], dtype=label, out=text)


def orchestrate(args, report: Report, log: Log, tracebacks: Tracebacks, start: float, live: list) -> int:
    """Install, the CUDA tests, then every group of plan() in its own worker (the next one starting while the
    current one runs), each outcome into the report as it comes."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    folder = args.out + ".workers"
    os.makedirs(folder, exist_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device] + ["--quick"] * args.quick
    cmd += [f"--inject-failure={s}" for s in args.inject_failure]

    def spawn(versions=False):
        live.append(Worker(cmd + ["--worker-versions"] * versions, folder, env))
        return live[-1]

    if args.install:
        report.steps.append(install(log, env))
        log(report.steps[-1])
        report.write()
    jobs = plan(args)
    nxt = spawn(versions=True) if jobs else None  # it imports torch while the tests run
    if args.tests:
        timeout = args.tests_timeout_s or min(240.0, args.budget_s / 2)
        report.steps.append(run_cuda_tests(args.tests, args.out + ".pytest.txt", timeout, env))
        log(report.steps[-1])
        report.write()
    if nxt is not None:
        ready = nxt.wait_ready(time.monotonic() + STARTUP_S)
        report.env = (ready or {}).get("versions") or (f"environment: unknown (the first worker did not get ready; "
                                                       f"see {os.path.basename(folder)}/{nxt.name}.out)")
        report.write()
        if ready and args.device == "cuda" and not ready["cuda"]:
            report.notes.append("no CUDA device: run with --device cpu for the dry run")
            print(report.notes[-1], file=sys.stderr)
            return 2
    skipped = []
    for i, job in enumerate(jobs):
        gid, elapsed = job["id"], time.monotonic() - start
        if elapsed > min(args.budget_s, args.deadline_s):
            skipped.append(gid)
            continue
        w, nxt = nxt or spawn(), None
        if i + 1 < len(jobs):
            nxt = spawn()
        report.status = (f"_in progress: group {gid} (worker {w.name}) since {elapsed:.0f} s; a report that ends here "
                         f"was cut short_")
        report.write()
        log(f"group {gid}: worker {w.name}", echo=False)
        got = {"rows": 0}

        def handle(rec, job=job, got=got):
            if "row" in rec:
                got["rows"] += 1
                log(report.add(rec["table"], job["id"], rec["row"]))
            elif "failed" in rec:
                f = rec["failed"]
                short = f"{f['type']}: {f['message']}".replace("\n", " ")[:160]
                ref = tracebacks.add(f"{job['id']} {json.dumps(f['key'])}", f["traceback"])
                cell = {"main": "backend", "models": "backends"}.get(f["table"], "out")
                log(report.add(f["table"], job["id"], dict(f["key"], **{cell: f"failed: {short} ({ref})"})))
            elif "fatal" in rec:
                log(report.add(job["table"], job["id"], failure_cells(job, "(rest of group)", rec["fatal"])))
            elif "note" in rec:
                log(f"{job['id']}: {rec['note']}", echo=False)

        outcome, secs = run_group(w, job, args.group_timeout_s, start + args.deadline_s, handle)
        live.remove(w)
        log(f"group {gid}: {outcome} after {secs:.1f} s ({got['rows']} rows)", echo=False)
        if outcome != "done":
            what = outcome_words(outcome, secs)
            ref = tracebacks.add(f"{gid}: {what}", w.evidence())
            cells = failure_cells(job, "(rest of group)" if got["rows"] else "all", f"failed: {what} ({ref})")
            log(report.add(job["table"], gid, cells))
    if nxt is not None:
        nxt.dismiss()
        live.remove(nxt)
    if skipped:
        report.notes.append(f"skipped (past the time budget {args.budget_s:.0f} s or the deadline "
                            f"{args.deadline_s:.0f} s): " + "; ".join(skipped))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args, dict(JOBS, models=model_rows))
    args.out = os.path.abspath(args.out or os.path.join(tempfile.mkdtemp(prefix="gpu_check_"), "gpu_check.md"))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    report = Report(args.out, [j["id"] for j in plan(args)])
    return supervised("gpu_check", args.out, report, report.notes.append,
                      lambda log, tracebacks, start, live: orchestrate(args, report, log, tracebacks, start, live))


if __name__ == "__main__":
    sys.exit(main())
