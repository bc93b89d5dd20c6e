"""A run killed with SIGKILL after a checkpoint and resumed logs bitwise the same per-step losses as an uninterrupted
run (CPU, fp32, subprocesses), also when the newest checkpoint was damaged and an older one is used."""
from __future__ import annotations

import os
import signal
import time

import pytest

from test_train_helpers import cli, read_records, sets, tiny, unfinish  # noqa: F401  (fixture)

STEPS = 40


def _args(tiny, out):
    return ["train", *sets(tiny + [f"train.steps={STEPS}", "train.checkpoint_every=3", "train.keep_checkpoints=20",
                                   "train.eval_every=10", "variant.name='affine'"]), "--out", str(out)]


def _losses(path):
    return [(r["step"], r["loss"], r["grad_norm"], r["alpha_ma"]) for r in read_records(path)]


def test_sigkill_then_resume_matches_uninterrupted(tiny, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    cli(_args(tiny, ref))
    log = tmp_path / "killed-run.log"
    proc = cli(_args(tiny, run), popen_log=log)
    try:
        deadline = time.time() + 240
        # Kill once the second checkpoint exists, so there is an older one to fall back to.
        while not (run / "checkpoints" / "step-00000006" / "MANIFEST.json").exists():
            assert proc.poll() is None, log.read_text()
            assert time.time() < deadline, log.read_text()
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:  # never leave the child running when the test fails
            proc.kill()
        proc.wait()
    assert not (run / "final").exists(), "the run finished before the kill; raise STEPS"
    steps = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    newest = run / "checkpoints" / steps[-1]
    # Damage the newest checkpoint: the resume must say so and use the previous one.
    weights = next((newest / "state").glob("*.safetensors"))  # a shard of the sharded checkpoint
    weights.write_bytes(weights.read_bytes()[:-64])
    out = cli(["train", *_args(tiny, run)[1:], "--resume"])
    assert f"{newest} is damaged" in out.stderr and "resuming from" in out.stderr
    assert steps[-2] in out.stderr.split("resuming from", 1)[1]
    assert _losses(run / "metrics.jsonl") == _losses(ref / "metrics.jsonl")
    evals = [(r["step"], r["heldout_loss"], r["qk_logit_mean"]) for r in read_records(run / "metrics.jsonl", "eval")]
    assert evals == [(r["step"], r["heldout_loss"], r["qk_logit_mean"])
                     for r in read_records(ref / "metrics.jsonl", "eval")]
    assert len(read_records(run / "metrics.jsonl", "resume")) == 1


def test_resume_refuses_a_changed_config_and_a_missing_run(tiny, tmp_path):
    from affine_attention.train.config_load import load_config
    from affine_attention.train.loop import train

    cfg = load_config("tiny", tiny + ["train.steps=2", "variant.name='sink'"])
    train(cfg, tmp_path / "r", log=lambda m: None)
    with pytest.raises(ValueError, match=r"already holds a run \(metrics.jsonl, result.json, final, checkpoints\)"):
        train(cfg, tmp_path / "r", log=lambda m: None)
    with pytest.raises(ValueError, match=r"different config \(optim.lr: checkpoint 0.003, now 0.5\)"):
        train(load_config("tiny", tiny + ["train.steps=2", "variant.name='sink'", "optim.lr=0.5"]), tmp_path / "r",
              resume=True, log=lambda m: None)
    said = []
    train(cfg, tmp_path / "r", resume=True, log=said.append)
    assert any("already complete" in m for m in said)
    with pytest.raises(ValueError, match="the run folder .* does not exist"):
        train(cfg, tmp_path / "nothing", resume=True, log=lambda m: None)
    assert not (tmp_path / "nothing").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no checkpoint in"):
        train(cfg, tmp_path / "empty", resume=True, log=lambda m: None)


def _killed_before_first_checkpoint(run):
    """Turn a finished run into what a kill before its first checkpoint leaves: its log with a last line cut
    mid-write, no final/, no result.json, and the empty checkpoints/ folder a first save starts in."""
    import shutil

    shutil.rmtree(run / "final")
    (run / "result.json").unlink()
    shutil.rmtree(run / "checkpoints")  # the last step's, written with final/
    (run / "checkpoints").mkdir()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 9, "lo')  # a line cut by the kill


def test_resume_before_the_first_checkpoint_starts_over_and_keeps_the_partial_log(tiny, tmp_path):
    from affine_attention.train.config_load import load_config
    from affine_attention.train.loop import train

    cfg = load_config("tiny", tiny + ["train.steps=3", "variant.name='affine'", "train.eval_every=3"])
    ref = train(cfg, tmp_path / "ref", log=lambda m: None)
    train(cfg, tmp_path / "run", log=lambda m: None)
    run = tmp_path / "run"
    _killed_before_first_checkpoint(run)
    partial = (run / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"different config \(optim.lr: run log 0.003, now 0.5\)"):
        train(load_config("tiny", tiny + ["train.steps=3", "variant.name='affine'", "train.eval_every=3",
                                          "optim.lr=0.5"]), run, resume=True, log=lambda m: None)
    said = []
    got = train(cfg, run, resume=True, log=said.append)
    assert any("has no checkpoint yet" in m and "metrics.restart-1.jsonl" in m for m in said), said
    assert (run / "metrics.restart-1.jsonl").read_text() == partial  # nothing written before is lost
    assert _losses(run / "metrics.jsonl") == _losses(tmp_path / "ref" / "metrics.jsonl")
    assert got["heldout_loss"] == ref["heldout_loss"] and (run / "final").is_dir()
    assert len(read_records(run / "metrics.jsonl", "config")) == 1

    # A second restart keeps both partial logs.
    _killed_before_first_checkpoint(run)
    train(cfg, run, resume=True, log=lambda m: None)
    assert (run / "metrics.restart-1.jsonl").read_text() == partial and (run / "metrics.restart-2.jsonl").is_file()


def test_compare_resume_restarts_a_sub_run_killed_before_its_first_checkpoint(tiny, tmp_path):
    from affine_attention.train.compare import compare
    from affine_attention.train.config_load import load_config

    cfg = load_config("tiny", tiny + ["train.steps=2", "compare.variants=['softmax', 'affine']"])
    first = compare(cfg, tmp_path / "cmp", seeds=1, log=lambda m: None)
    _killed_before_first_checkpoint(tmp_path / "cmp" / "affine" / "seed0")
    said = []
    again = compare(cfg, tmp_path / "cmp", seeds=1, resume=True, log=said.append)
    assert any("softmax seed 0: already done" in m for m in said)
    assert any("has no checkpoint yet" in m for m in said)
    for v in ("softmax", "affine"):
        assert again["variants"][v]["heldout_loss"] == first["variants"][v]["heldout_loss"]


def test_resume_with_another_architecture_is_refused_before_any_weight_is_read(tiny, tmp_path):
    """The config check comes before the checkpoint's tensors are loaded: another width used to end in a
    size-mismatch RuntimeError from the state-dict load instead of naming the changed setting."""
    from affine_attention.train.config_load import load_config
    from affine_attention.train.loop import train

    run = tmp_path / "r"
    train(load_config("tiny", tiny + ["train.steps=2", "train.checkpoint_every=1"]), run, log=lambda m: None)
    unfinish(run)  # an unfinished run: resume reads its step checkpoint
    with pytest.raises(ValueError, match=r"different config \(model.hidden_size: checkpoint 32, now 64"):
        train(load_config("tiny", tiny + ["train.steps=2", "train.checkpoint_every=1", "model.hidden_size=64"]), run,
              resume=True, log=lambda m: None)
