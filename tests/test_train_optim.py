"""Learning-rate schedules at their boundary steps, and which parameters get weight decay."""
from __future__ import annotations

import math

import pytest
import torch

from affine_attention.train.config import OptimConfig, ScheduleConfig
from affine_attention.train.optim import build_optimizer, lr_factor, param_groups, set_lr


def test_warmup_reaches_peak_on_its_last_step():
    cfg = ScheduleConfig(kind="wsd", warmup_steps=4, decay_fraction=0.2, decay_shape="linear")
    assert [lr_factor(s, 100, cfg) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


@pytest.mark.parametrize("shape", ["linear", "1-sqrt"])
def test_wsd_boundaries(shape):
    cfg = ScheduleConfig(kind="wsd", warmup_steps=10, decay_fraction=0.2, decay_shape=shape, min_lr_ratio=0.1)
    total = 100  # decay starts at step 80 and would reach 0.1 at step 100 (one past the last)
    assert lr_factor(79, total, cfg) == 1.0
    assert lr_factor(80, total, cfg) == 1.0  # the first decay step is still at the peak
    p = 10 / 20
    expected = 1 - 0.9 * p if shape == "linear" else 0.1 + 0.9 * (1 - math.sqrt(p))
    assert lr_factor(90, total, cfg) == pytest.approx(expected, abs=1e-15)
    last = 19 / 20
    expected = 1 - 0.9 * last if shape == "linear" else 0.1 + 0.9 * (1 - math.sqrt(last))
    assert lr_factor(99, total, cfg) == pytest.approx(expected, abs=1e-15)
    assert lr_factor(100, total, cfg) == pytest.approx(0.1)
    values = [lr_factor(s, total, cfg) for s in range(80, 101)]
    assert all(a > b for a, b in zip(values, values[1:]))  # strictly decreasing through the decay


def test_wsd_decay_never_starts_inside_warmup():
    cfg = ScheduleConfig(kind="wsd", warmup_steps=10, decay_fraction=0.9, decay_shape="linear")
    assert lr_factor(9, 20, cfg) == 1.0 and lr_factor(10, 20, cfg) == 1.0
    assert lr_factor(15, 20, cfg) == pytest.approx(0.5)


def test_cosine_and_constant():
    cos = ScheduleConfig(kind="cosine", warmup_steps=10, min_lr_ratio=0.0)
    assert lr_factor(10, 110, cos) == 1.0
    assert lr_factor(60, 110, cos) == pytest.approx(0.5)
    assert lr_factor(110, 110, cos) == pytest.approx(0.0, abs=1e-15)
    const = ScheduleConfig(kind="constant", warmup_steps=2)
    assert [lr_factor(s, 10, const) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]


def test_set_lr_sets_every_group():
    opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(2))]},
                             {"params": [torch.nn.Parameter(torch.zeros(2))]}], lr=1.0)
    lr = set_lr(opt, 0, 10, 2e-3, ScheduleConfig(warmup_steps=4))
    assert lr == pytest.approx(5e-4) and all(g["lr"] == lr for g in opt.param_groups)


@pytest.fixture(scope="module")
def sink_and_affine_models():
    from affine_attention.train.config import ModelConfig
    from affine_attention.train.model import build_base, convert

    base = build_base(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                  vocab_size=64), seed=0)
    return {v: convert(base, v) for v in ("sink", "affine", "affine_gated")}


def test_weight_decay_groups(sink_and_affine_models):
    for variant, model in sink_and_affine_models.items():
        decay, no_decay = param_groups(model, OptimConfig(weight_decay=0.1))
        assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
        names_decay, names_none = set(decay["names"]), set(no_decay["names"])
        assert "model.embed_tokens.weight" in names_none  # embeddings (and the head tied to them): no decay
        assert "lm_head.weight" not in names_decay | names_none  # tied: listed once, as the embedding
        assert all(n.endswith("norm.weight") or n.endswith(".sinks") or n == "model.embed_tokens.weight"
                   for n in names_none), names_none
        assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"} <= names_decay
        if variant == "sink":
            assert "model.layers.0.self_attn.attn_variant.sinks" in names_none
        else:
            assert "model.layers.0.self_attn.attn_variant.alpha_proj.weight" in names_decay
        if variant == "affine_gated":
            assert "model.layers.1.self_attn.attn_variant.gate_proj.weight" in names_decay
        n_params = len({id(p) for p in model.parameters()})
        assert len(decay["params"]) + len(no_decay["params"]) == n_params


def test_decay_embeddings_option(sink_and_affine_models):
    model = sink_and_affine_models["affine"]
    decay, _ = param_groups(model, OptimConfig(decay_embeddings=True))
    assert "model.embed_tokens.weight" in decay["names"]
    opt = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.1))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
