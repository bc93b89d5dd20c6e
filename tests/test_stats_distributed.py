"""alpha_ma does not depend on the parallel layout: 2 gloo ranks (torchrun, DDP with its default buffer broadcast,
activation checkpointing on one rank) x 2 micro-batches equal 1 process x 1 batch of the same tokens."""
from __future__ import annotations

from pathlib import Path

import torch
from stats_layout import alpha_ma, train
from torchrun_helpers import torchrun

HERE = Path(__file__).resolve().parent


def test_two_ranks_two_micro_batches_equal_one_process_one_batch(tmp_path):
    torchrun([str(HERE / "stats_layout.py"), str(tmp_path), "2"], pythonpath=[str(HERE.parent), str(HERE)])
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True)["alpha_ma"] for r in (0, 1))
    assert torch.equal(a, b)  # one integer all-reduce: the same bits on every rank
    ref = alpha_ma(train(micro=1))
    assert (a - ref).abs().max() <= 1e-6, (a - ref).abs().max()
    assert (ref - ref.mean()).abs().max() > 1e-3  # input-dependent, so a wrong token weighting would show
