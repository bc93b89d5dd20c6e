"""The KD teacher sharded with FSDP2 across 2 gloo ranks gives the whole teacher's KD loss and student gradient, holds
about half of its parameters per rank, and its cached top-k targets stay equal when one rank's rows are cached and its
peer's are not (the forward is collective); a 2-rank FSDP2 KD run with it follows the one-process run. torchrun with
2 processes (~20-60 s each): slow suite."""
from __future__ import annotations

import json

import pytest
import torch
from test_train_helpers import REPO, tiny  # noqa: F401  (fixture)
from torchrun_helpers import torchrun


@pytest.fixture
def teacher_folder(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from affine_attention.train.pretrained import load_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.save_pretrained(tmp_path / "teacher")
    load_tokenizer("default").save_pretrained(tmp_path / "teacher")
    return tmp_path / "teacher"


@pytest.mark.slow
def test_sharded_teacher_gives_the_whole_teachers_kd_loss(teacher_folder, tmp_path):
    (tmp_path / "ranks").mkdir()
    torchrun([str(REPO / "tests" / "teacher_shard_worker.py"), str(teacher_folder), str(tmp_path / "cache"),
              str(tmp_path / "ranks")], pythonpath=[str(REPO), str(REPO / "tests")])
    ranks = [json.loads(p.read_text()) for p in sorted((tmp_path / "ranks").glob("rank*.json"))]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        whole, sharded = r["whole"], r["sharded"]
        assert sharded["loss"] == pytest.approx(whole["loss"], rel=1e-6, abs=0)
        assert sharded["kd"] == pytest.approx(whole["kd"], rel=1e-6, abs=0)
        assert max(abs(a - b) for a, b in zip(sharded["grad"], whole["grad"])) <= 1e-6 * max(map(abs, whole["grad"]))
        assert whole["kd"] > 0.01  # a real distance between two different models, not 0 = 0
        # 1/world of every parameter (each dim-0 shard of an odd size rounds up), none left gathered after release.
        assert sharded["all_sharded"] and not whole["all_sharded"]
        assert 0.45 * whole["param_bytes"] <= sharded["param_bytes"] <= 0.55 * whole["param_bytes"]
        assert r["topk_diff"] == 0.0


@pytest.mark.slow
def test_fsdp_kd_training_with_the_sharded_teacher_follows_one_process(teacher_folder, tiny, tmp_path):
    from test_train_helpers import cli, read_records, sets

    common = tiny + ["train.steps=3", "train.global_batch=8", "kd.enabled=true", f"kd.teacher='{teacher_folder}'",
                     "kd.teacher_dtype='float32'", "kd.kd_alpha=0.5", "variant.name='affine'", "train.eval_every=3"]
    cli(["train", *sets(common + ["train.micro_batch=4"]), "--out", str(tmp_path / "single")])
    torchrun(["-m", "affine_attention.cli", "train", *sets(common + ["train.micro_batch=2", "train.parallel='fsdp'"]),
              "--out", str(tmp_path / "fsdp")], pythonpath=[str(REPO)])
    for kind, keys in (("train", ("loss", "kd_loss")), ("eval", ("heldout_loss",))):
        want, got = read_records(tmp_path / "single" / "metrics.jsonl", kind), \
            read_records(tmp_path / "fsdp" / "metrics.jsonl", kind)
        assert len(got) == len(want) > 0
        for a, b in zip(got, want):
            for k in keys:
                assert abs(a[k] - b[k]) <= 1e-5, (kind, k, a[k], b[k])
