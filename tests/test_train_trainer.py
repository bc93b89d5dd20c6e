"""The trainer's named steps one at a time: building, the config record, one step (forward_backward ->
optimizer_step -> after_optimizer_step -> log_step), evaluation, the result."""
from __future__ import annotations

import torch

from affine_attention.train.config_load import load_config
from affine_attention.train.loop import Trainer
from test_train_helpers import read_records, tiny  # noqa: F401  (fixture)


def test_steps_one_by_one(tiny, tmp_path, monkeypatch):
    cfg = load_config("tiny", tiny + ["train.steps=2", "variant.name='affine'"])
    t = Trainer(cfg, tmp_path / "run", log=lambda m: None)
    assert t.n_micro == 2 and t.held.shape == (4, 33) and t.teacher is None
    t.start()
    assert read_records(tmp_path / "run" / "metrics.jsonl", "config")[0]["variant"] == "affine"

    rows, ids = t.batches.next()
    before = [p.detach().clone() for p in t.model.parameters()]
    sums = t.forward_backward(rows, ids)
    assert sums.shape == (3,) and sums[0] == sums[1] and sums[2] == 0  # CE only: loss == ce, no kd
    assert all(p.grad is not None for p in t.model.parameters() if p.requires_grad)
    grad_norm = t.optimizer_step()
    assert grad_norm > 0 and all(p.grad is None for p in t.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, t.model.parameters()))

    calls = []
    monkeypatch.setattr(t, "after_optimizer_step", lambda: calls.append(len(calls)))
    t.begin()
    t.train_step(1)
    assert calls == [0]  # once per optimizer step
    rec = read_records(tmp_path / "run" / "metrics.jsonl")[-1]
    assert rec["step"] == 2 and len(rec["alpha_mean"]) == 2 and len(rec["alpha_ma"]) == 2
    ev = t.evaluate(2)
    assert ev["kind"] == "eval" and len(ev["alpha_ma"]) == 2 and len(ev["alpha_ma"][0]) == cfg.model.num_heads
    result = t.finish()
    assert result["heldout_loss"] == ev["heldout_loss"] and result["running_stats_max_rank_diff"] == 0.0
