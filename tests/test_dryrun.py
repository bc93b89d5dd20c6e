"""The dry run's estimates (per-term memory, FLOPs, throughput, compare wall clock; the formula's check against
measured memory is benchmarks/bench_dryrun.py) and the per-step cost metrics a run logs."""
from __future__ import annotations

import json

import pytest

from affine_attention.cli import main
from affine_attention.train.config_load import load_config
from affine_attention.train.dryrun import compare_estimate, dry_run, flops_per_token, format_dry_run, memory_terms, \
    sizes
from test_train_helpers import read_records, tiny  # noqa: F401  (fixture)

GiB = 2**30


def test_fsdp_accumulation_keeps_unsharded_gradients_and_checkpointing_saves_activations():
    cfg = load_config("paper-1b")
    p = 1_236_862_976
    sharded = memory_terms(cfg, p, world=8, bf16=True)
    # 32 accumulation rounds under FSDP2: each rank keeps the full fp32 gradients (4P) besides its shard (4P/8).
    assert sharded["gradients"] == pytest.approx(4 * p + 4 * p / 8)
    assert sharded["optimizer"] == pytest.approx(8 * p / 8)
    no_accum = memory_terms(load_config("paper-1b", ["train.micro_batch=128"]), p, world=8, bf16=True)
    assert no_accum["gradients"] == pytest.approx(4 * p / 8)
    full = memory_terms(load_config("paper-1b", ["train.activation_checkpointing=false"]), p, world=8, bf16=True)
    assert full["activations"] > 5 * sharded["activations"]
    fp32 = memory_terms(load_config("paper-1b", ["train.activation_checkpointing=false"]), p, world=8, bf16=False)
    assert 1.2 * full["activations"] < fp32["activations"] < 2 * full["activations"]  # the residual stays fp32
    # Checkpointed layer inputs are the fp32 residual stream even under bf16 autocast.
    assert sharded["activations"] > 4 * 2048 * 4 * 2048 * 16
    # The loss works on chunks: its term grows with the chunk, not with the micro-batch.
    whole = memory_terms(load_config("paper-1b", ["train.loss_chunk_tokens=0"]), p, world=8, bf16=True)
    assert whole["logits + loss"] > 5 * sharded["logits + loss"]
    assert sharded["teacher weights"] == 0  # no teacher passed
    assert sharded["peak"] == pytest.approx(sum(sharded[k] for k in ("parameters", "gradients", "optimizer",
                                                                     "activations", "logits + loss")))


@pytest.mark.slow  # ~10 s: the 1B model and its converted copies on the meta device
def test_paper_1b_plan_counts_its_teacher_and_flops():
    r = dry_run(load_config("paper-1b"), world=8)
    mem, t = r["memory"], r["throughput"]
    # Llama-3.2-3B in bf16, sharded over 8 ranks, with its tied embeddings (394M) and two layers gathered
    p_t, layer = 3_212_749_824, (3072 * 3072 * 2 + 3072 * 1024 * 2 + 3 * 3072 * 8192 + 2 * 3072)
    assert mem["teacher weights"] == pytest.approx(2 * (p_t / 8 + 128256 * 3072 + 3072 + 2 * layer))
    assert 10 * GiB < mem["peak"] < 20 * GiB
    cfg = load_config("paper-1b")
    student = 6 * (1_236_862_976) + 12 * 16 * 32 * 64 * 2048  # tied head: the matmul counts, the embedding not
    assert t["student_flops_per_token"] == pytest.approx(student)
    assert flops_per_token(params=1_236_862_976, seq=2048, forward_only=True, **sizes(cfg.model)) == \
        pytest.approx(student / 3)
    assert t["tokens_per_s_per_gpu"] == pytest.approx(0.35 * 989e12 / (student + t["teacher_flops_per_token"]))
    assert "3 variants x 2 seed(s) x 9,000 steps, one after another" in compare_estimate(r, 3, 2)
    # In lockstep the teacher runs once per step for the 3 variants: (3 S + T) / (S + T) runs' time per seed.
    s, te = t["student_flops_per_token"], t["teacher_flops_per_token"]
    assert f"= {t['run_hours'] * 2 * (3 * s + te) / (s + te):,.1f} h" in compare_estimate(r, 3, 2, shared=True)
    text = format_dry_run(r, "affine")
    assert "ESTIMATED memory per GPU" in text and "ASSUMED MFU 35%" in text and "8 x H200" in text


def test_compare_dry_run_states_the_wall_clock_of_every_variant_and_seed(capsys):
    assert main(["compare", "--config", "tiny", "--dry-run", "--world", "1", "--gpu", "h100", "--seeds", "3"]) == 0
    out = capsys.readouterr().out
    cfg = load_config("tiny")
    assert (f"ESTIMATED compare wall clock: {len(cfg.compare.variants)} variants x 3 seed(s) x {cfg.train.steps} "
            "steps") in out and "1 x H100" in out
    line = compare_estimate({"throughput": {"run_hours": 2.0, "gpu": "h200"}, "steps": 9000, "world": 8}, 3, 2)
    assert "3 variants x 2 seed(s) x 9,000 steps, one after another = 12.0 h (0.5 days) on 8 x H200" in line


def test_a_run_logs_data_wait_and_says_mfu_and_host_syncs_are_not_measured_on_cpu(tiny, tmp_path):
    from affine_attention.analysis.report_tables import throughput_cell
    from affine_attention.train.loop import train

    result = train(load_config("tiny", tiny + ["train.steps=2"]), tmp_path / "r", log=lambda s: None)
    for rec in read_records(tmp_path / "r" / "metrics.jsonl"):
        assert rec["data_wait_s"] >= 0 and rec["host_syncs"] is None and rec["mfu"] is None
        assert rec["student_flops_per_s"] > 0 and rec["teacher_flops_per_s"] == 0
    assert result["mfu"] is None and result["host_syncs_per_step"] is None and result["data_wait_s_per_step"] >= 0
    assert json.loads((tmp_path / "r" / "result.json").read_text())["data_wait_s_per_step"] >= 0
    cell = throughput_cell([result])
    assert "MFU not measured" in cell and "host syncs counted on CUDA only" in cell and "ms/step" in cell
    assert "MFU 40.0%" in throughput_cell([{"tokens_per_s": 1.0, "mfu": 0.4, "data_wait_s_per_step": 0.01,
                                            "host_syncs_per_step": 3.0}])


def test_step_cost_mfu_against_a_peak():
    import torch

    from affine_attention.train import metrics
    from affine_attention.train.model import build_base

    model = build_base(load_config("tiny").model, 0)
    cost = metrics.StepCost(model, 1000, 32, 64, 1, torch.device("cpu"))
    cost.peak = 1e9
    rec = cost.record(2.0)
    assert rec["mfu"] == pytest.approx(cost.student / 2.0 / 1e9) and rec["mfu_teacher"] == 0.0
