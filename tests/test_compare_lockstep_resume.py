"""A lockstep compare (shared live KD teacher) killed between its variants' checkpoint writes, so that one variant's
newest checkpoint is a step behind the other's, resumes to bitwise the per-step losses, evaluations and final weights
of the uninterrupted run, still with one teacher forward per micro-batch; also when the one behind is the first run
(its newest checkpoint damaged). The killed state is made from the real checkpoints of a real run: the newer
checkpoints and what the kill would not have written are removed."""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file

from affine_attention.train.compare import compare
from affine_attention.train.config_load import load_config
from affine_attention.train.kd import Teacher
from test_compare_shared_teacher import teacher_folder  # noqa: F401  (fixture)
from test_train_helpers import read_records, tiny  # noqa: F401  (fixture)

STEPS, AHEAD, BEHIND = 5, 3, 2  # checkpoint every step: one variant saved step 3, the kill hit before the other's


def _records(run):
    train = [(r["step"], r["loss"], r["kd_loss"], r["grad_norm"], r.get("alpha_ma"))
             for r in read_records(run / "metrics.jsonl")]
    evals = [(r["step"], r["heldout_loss"], r["qk_logit_mean"]) for r in read_records(run / "metrics.jsonl", "eval")]
    return train, evals


def _killed_at(run, step):
    """What a compare killed between its variants' saves of step AHEAD leaves in the run folder `run` whose newest
    checkpoint is of `step`: no newer checkpoint, no final/ or result.json, the log cut after step AHEAD (the variant
    behind had logged that step's training; its save is what the kill stopped)."""
    for p in (run / "checkpoints").glob("step-*"):
        if int(p.name.split("-")[1]) > step:
            shutil.rmtree(p)
    shutil.rmtree(run / "final")
    (run / "result.json").unlink()
    lines = [line for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("kind") != "end" and json.loads(line).get("step", -1) <= AHEAD]
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))


@pytest.mark.slow
# A kill between the two saves of step 3 leaves the first variant ahead. A kill after both, with the first run's step 3
# damaged, leaves the first run (the teacher's owner) behind: it resumes from step 2 and trains alone to catch up.
@pytest.mark.parametrize("how, ahead, behind", [("kill", "softmax", "affine"), ("damage", "affine", "softmax")])
def test_lockstep_compare_resumes_a_variant_one_checkpoint_behind(tiny, teacher_folder, tmp_path, monkeypatch, how,
                                                                  ahead, behind):
    cfg = load_config("tiny", tiny + [f"train.steps={STEPS}", "train.checkpoint_every=1", "train.keep_checkpoints=20",
                                      "train.eval_every=2", "compare.variants=['softmax', 'affine']",
                                      "kd.enabled=true", f"kd.teacher='{teacher_folder}'",
                                      "kd.teacher_dtype='float32'", "kd.kd_alpha=0.5", "kd.temperature=2.0"])
    out = tmp_path / "cmp"
    first = compare(cfg, out, seeds=1, log=lambda m: None)
    runs = {v: out / v / "seed0" for v in ("softmax", "affine")}
    want = {v: _records(r) for v, r in runs.items()}
    weights = {v: load_file(str(r / "final" / "model.safetensors")) for v, r in runs.items()}
    assert [s for s, *_ in want["affine"][0]] == list(range(1, STEPS + 1))
    _killed_at(runs[ahead], AHEAD)
    _killed_at(runs[behind], BEHIND if how == "kill" else AHEAD)
    if how == "damage":
        shard = next((runs[behind] / "checkpoints" / "step-00000003" / "state").glob("*.safetensors"))
        shard.write_bytes(shard.read_bytes()[:-64])

    forwards = []
    real = Teacher._forward
    monkeypatch.setattr(Teacher, "_forward", lambda self, inputs: forwards.append(len(inputs)) or real(self, inputs))
    said = []
    again = compare(cfg, out, seeds=1, resume=True, log=said.append)
    assert any(f"resuming from {runs[ahead] / 'checkpoints' / 'step-00000003'}" in m for m in said), said
    assert any(f"resuming from {runs[behind] / 'checkpoints' / 'step-00000002'}" in m for m in said), said
    assert any("is damaged" in m for m in said) == (how == "damage"), said
    for v, run in runs.items():
        assert _records(run) == want[v], v
        got = load_file(str(run / "final" / "model.safetensors"))
        assert got.keys() == weights[v].keys() and all((got[k] == weights[v][k]).all() for k in got), v
        assert again["variants"][v]["heldout_loss"] == first["variants"][v]["heldout_loss"]
    # The one behind trains step 3 alone, then both steps 4 and 5 on one teacher forward per micro-batch (2 a step).
    assert len(forwards) == 2 * (STEPS - BEHIND), forwards
