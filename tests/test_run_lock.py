"""A run folder is held by one process at a time: a second `--resume` of a live run stops with an error naming the
folder and the holder's pid, a killed holder leaves nothing stuck, and only rank 0 holds the folder."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from test_train_helpers import REPO, read_records, tiny, unfinish  # noqa: F401  (fixture)

STEPS = ["train.steps=4", "train.checkpoint_every=2", "variant.name='affine'"]

# Holds the run folder the way a live `train --resume` does (a Trainer built, not yet done), then waits.
HOLDER = """
import json, sys
from affine_attention.train.config_load import load_config
from affine_attention.train.loop import Trainer
t = Trainer(load_config("tiny", json.loads(sys.argv[1])), sys.argv[2], resume=True, log=lambda m: None)
print("holding", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def stopped_run(tiny, tmp_path):
    """(config, run folder) of a run stopped after its step-2 checkpoint: steps 3 and 4 are left to resume."""
    from affine_attention.train.config_load import load_config
    from affine_attention.train.loop import train

    cfg = load_config("tiny", tiny + STEPS)
    run = tmp_path / "run"
    train(cfg, run, log=lambda m: None)
    unfinish(run)
    return cfg, run


def test_a_second_resume_of_a_live_run_is_refused_and_a_killed_holder_leaves_nothing_stuck(tiny, stopped_run):
    from affine_attention.train.loop import train

    cfg, run = stopped_run
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, json.dumps(tiny + STEPS), str(run)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(ValueError) as err:
            train(cfg, run, resume=True, log=lambda m: None)
        message = str(err.value)
        assert f"the run folder {run} is held by another run (pid {holder.pid})" in message
        assert "\n" not in message
        os.kill(holder.pid, signal.SIGKILL)  # dies holding the folder
        holder.wait()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    got = train(cfg, run, resume=True, log=lambda m: None)  # the dead holder's lock went with it
    assert got["steps"] == 4
    assert [r["step"] for r in read_records(run / "metrics.jsonl")] == [1, 2, 3, 4]  # each step logged once
    assert [r["step"] for r in read_records(run / "metrics.jsonl", "resume")] == [2]


def test_only_rank_0_holds_the_folder_and_a_finished_run_gives_it_back(stopped_run, monkeypatch):
    from affine_attention.train import loop
    from affine_attention.train.distributed import DistInfo

    cfg, run = stopped_run
    first = loop.Trainer(cfg, run, resume=True, log=lambda m: None)
    with pytest.raises(ValueError, match=rf"held by another run \(pid {os.getpid()}\)"):
        loop.Trainer(cfg, run, resume=True, log=lambda m: None)
    # A rank other than 0 (torchrun) follows rank 0 and holds nothing, so it is not refused.
    monkeypatch.setattr(loop, "setup", lambda device: DistInfo(rank=1, world=1))
    other = loop.Trainer(cfg, run, resume=True, log=lambda m: None)
    assert other.lock is None and first.lock is not None
    monkeypatch.undo()
    assert first.run()["steps"] == 4
    assert (run / ".lock").read_text() == ""  # given back: no stale pid left for the next holder
    assert loop.train(cfg, run, resume=True, log=lambda m: None)["steps"] == 4  # and it can be taken again
