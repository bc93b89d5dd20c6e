"""Shared helpers for the training tests (no tests here): a tiny model and a small local dataset, offline."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A 2-layer Llama of width 32 on 32-token sequences: a step takes milliseconds on a CPU.
TINY = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "model.num_heads=2",
    "model.num_kv_heads=1", "data.seq_len=32", "train.global_batch=4", "train.micro_batch=2",
    "data.eval_sequences=4", "data.eval_batch=4", "data.probe_sequences=1", "schedule.warmup_steps=2",
    "train.eval_every=0", "train.log_every=1000", "train.threads=1", "train.device='cpu'",
]


def write_small_corpus(folder: Path) -> tuple[Path, Path]:
    """Two JSONL files cut from the embedded corpus (train: 6 works x 6k chars, eval: 2 works x 6k chars)."""
    from affine_attention.text.corpus import corpus_texts

    folder.mkdir(parents=True, exist_ok=True)
    train, evals = folder / "train.jsonl", folder / "eval.jsonl"
    train.write_text("".join(json.dumps({"text": t[:6000]}) + "\n" for t in corpus_texts("train")[:6]))
    evals.write_text("".join(json.dumps({"text": t[:6000]}) + "\n" for t in corpus_texts("validation")[:2]))
    return train, evals


def tiny_overrides(folder: Path) -> list[str]:
    train, evals = write_small_corpus(folder / "data")
    return TINY + [
        "data.train.kind='files'", f"data.train.paths=['{train}']",
        "data.eval.kind='files'", f"data.eval.paths=['{evals}']",
        f"data.token_cache_dir='{folder / 'tokens'}'",
    ]


@pytest.fixture
def tiny(tmp_path) -> list[str]:
    return tiny_overrides(tmp_path)


@pytest.fixture(scope="module")
def tok():
    """The packaged 4096-token tokenizer, as training loads it."""
    from affine_attention.train.pretrained import load_tokenizer

    return load_tokenizer("default")


def write_jsonl(path: Path, docs: list[str]) -> Path:
    """A JSON Lines file with one {"text": doc} object per document."""
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def read_records(path: Path, kind: str = "train") -> list[dict]:
    return [r for r in map(json.loads, Path(path).read_text().splitlines()) if r.get("kind") == kind]


def cli(args: list[str], *, env: dict | None = None, timeout: float = 300, check: bool = True,
        popen_log: Path | None = None):
    """Run `python -m affine_attention.cli ARGS` in a subprocess (one thread, repository on the path).

    With popen_log, start it in the background with its output going to that file: a pipe nobody reads while the
    test polls would fill up and block the child."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    cmd = [sys.executable, "-m", "affine_attention.cli", *args]
    if popen_log is not None:
        with open(popen_log, "w") as log:
            return subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT, text=True)
    out = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out


def cli_in_process(args: list[str]) -> subprocess.CompletedProcess:
    """`affine-attention ARGS` through cli.main in this process, as a CompletedProcess (exit code, stdout, stderr):
    a second of set-up less than `cli` for tests of what the command says. An exception other than the command's
    own exit propagates, so a traceback fails the test as it would on a terminal. Restores torch's thread count."""
    import contextlib
    import io

    import torch

    from affine_attention.cli import main

    out, err, threads = io.StringIO(), io.StringIO(), torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as exit_:  # argparse's usage errors
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["affine-attention", *args], code, out.getvalue(), err.getvalue())


def sets(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def unfinish(run: Path) -> None:
    """What a kill after the last periodic checkpoint leaves of a finished run: no final/, no result.json and no
    checkpoint of the last step (the trainer writes it with final/; the full format of older runs did not)."""
    import shutil

    step = json.loads((run / "final" / "MANIFEST.json").read_text())["step"]
    shutil.rmtree(run / "final")
    last = run / "checkpoints" / f"step-{step:08d}"
    if last.is_dir():
        shutil.rmtree(last)
    (run / "result.json").unlink()
