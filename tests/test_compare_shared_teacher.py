"""`compare` with a live KD teacher steps a seed's variants in lockstep and runs the teacher once per micro-batch for
all of them, with every run's losses equal to those it gets when the variants train one after another; a resumed
compare whose one run is finished trains the other alone."""
from __future__ import annotations

import pytest
import torch

from affine_attention.train.compare import compare
from affine_attention.train.config_load import load_config
from affine_attention.train.kd import Teacher
from test_train_helpers import read_records, tiny  # noqa: F401  (fixture)


@pytest.fixture
def teacher_folder(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from affine_attention.train.pretrained import load_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "teacher")
    load_tokenizer("default").save_pretrained(tmp_path / "teacher")
    return tmp_path / "teacher"


def _teacher_flops(run):
    """The teacher FLOPs each step of a run was charged: teacher_flops_per_s x the step's seconds."""
    per_step = read_records(run / "metrics.jsonl", "config")[0]["tokens_per_step"]
    return [r["teacher_flops_per_s"] * per_step / r["tokens_per_s"] for r in read_records(run / "metrics.jsonl")]


def _losses(run):
    return [(r["step"], r["loss"], r["kd_loss"], r["grad_norm"]) for r in read_records(run / "metrics.jsonl")]


def test_variants_share_one_teacher_forward_and_keep_their_losses(tiny, teacher_folder, tmp_path, monkeypatch):
    forwards = []
    real = Teacher._forward
    monkeypatch.setattr(Teacher, "_forward", lambda self, inputs: forwards.append(len(inputs)) or real(self, inputs))
    common = tiny + ["train.steps=3", "compare.variants=['softmax', 'affine']", "kd.enabled=true",
                     f"kd.teacher='{teacher_folder}'", "kd.teacher_dtype='float32'", "kd.kd_alpha=0.5",
                     "kd.temperature=2.0"]
    said = []
    compare(load_config("tiny", common), tmp_path / "shared", seeds=1, log=said.append)
    shared = len(forwards)
    forwards.clear()
    compare(load_config("tiny", common + ["compare.share_teacher=false"]), tmp_path / "apart", seeds=1,
            log=lambda m: None)
    # 3 steps x 2 micro-batches (global batch 4, micro-batch 2): once for both variants, against once per variant.
    assert (shared, len(forwards)) == (6, 12)
    assert any("in lockstep" in m for m in said), said
    for v in ("softmax", "affine"):
        got, want = _losses(tmp_path / "shared" / v / "seed0"), _losses(tmp_path / "apart" / v / "seed0")
        assert len(got) == 3 and got == want, (v, got, want)
        assert (tmp_path / "shared" / v / "seed0" / "final" / "model.safetensors").is_file()
    assert _losses(tmp_path / "shared" / "softmax" / "seed0") != _losses(tmp_path / "shared" / "affine" / "seed0")
    # One forward per step in all: charged to the run whose step ran it (softmax, stepped first), not to each run.
    alone = _teacher_flops(tmp_path / "apart" / "softmax" / "seed0")
    assert alone[0] > 0 and _teacher_flops(tmp_path / "apart" / "affine" / "seed0") == pytest.approx(alone)
    assert _teacher_flops(tmp_path / "shared" / "softmax" / "seed0") == pytest.approx(alone)
    assert _teacher_flops(tmp_path / "shared" / "affine" / "seed0") == [0.0] * 3
