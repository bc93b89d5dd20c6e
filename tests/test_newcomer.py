"""The stumbles of a first walk through the README (issue 35), each as what the user meets: `train --out DIR
--resume` with the run's own config, and the command-line ends of analyze, compare and report."""
from __future__ import annotations

import pytest
from test_train_helpers import cli_in_process, sets, tiny  # noqa: F401  (fixture)


def test_resume_uses_the_runs_saved_config_and_refuses_a_different_one(tiny, tmp_path):  # noqa: F811
    from affine_attention.train.config_load import load_config
    from affine_attention.train.loop import train

    run = tmp_path / "r"
    train(load_config("tiny", tiny + ["train.steps=2", "variant.name='sink'"]), run, log=lambda m: None)
    # The README's line, without repeating the run's --set flags.
    done = cli_in_process(["train", "--out", str(run), "--resume"])
    assert done.returncode == 0, done.stderr
    assert "already complete" in done.stderr
    # --set on top of the saved config: a key that changes nothing computed passes, any other is refused.
    assert cli_in_process(["train", "--out", str(run), "--resume", "--set", "train.log_every=5"]).returncode == 0
    changed = cli_in_process(["train", "--out", str(run), "--resume", "--set", "optim.lr=0.5"])
    assert changed.returncode != 0 and "different config (optim.lr" in changed.stderr
    # An explicitly given config is still checked against the run's, as before.
    other = cli_in_process(["train", "--out", str(run), "--resume", "--config", "tiny"])
    assert other.returncode != 0 and "different config" in other.stderr
    (tmp_path / "bare").mkdir()
    bare = cli_in_process(["train", "--out", str(tmp_path / "bare"), "--resume"])
    assert bare.returncode != 0 and "run's config is unknown" in bare.stderr
