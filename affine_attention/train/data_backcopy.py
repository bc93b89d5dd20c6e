"""The Bigram-Backcopy task (text/backcopy.py) as a training data source and as a tokenizer.

Sequence i of a split is drawn from its own generator seeded by (task, split, run seed, i): deterministic per seed,
resumable from one integer, and independent of the batch size. The validation split ignores the run seed, so every
run of a comparison is evaluated on the same held-out sequences, which the analysis draws again by the same rule.

The vocabulary is its own tokenizer ("backcopy:<transitions>:<vocab>", which config_load writes into data.tokenizer),
so the model's output layer has vocab + 1 rows instead of the packaged tokenizer's 4096; the token strings are the
corpus tokens they stand for (or w1, w2, ... for a random chain), which keeps decoded sequences readable.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from ..text.backcopy import BackcopyTask, task
from .config import BackcopyConfig

SPEC_PREFIX = "backcopy:"


def task_of(bc: BackcopyConfig) -> BackcopyTask:
    """The task a [data.backcopy] table describes."""
    return task(**dataclasses.asdict(bc))


def tokenizer_spec(bc: BackcopyConfig) -> str:
    """The data.tokenizer a backcopy source implies: its vocabulary depends on the transitions and their size only."""
    return f"{SPEC_PREFIX}{bc.transitions}:{bc.vocab}"


def tokenizer_from_spec(spec: str):
    """The tokenizer of a "backcopy:<transitions>:<vocab>" spec (see `tokenizer_spec`)."""
    try:
        transitions, vocab = spec[len(SPEC_PREFIX):].split(":")
        t = task(transitions, int(vocab), triggers=1)  # the vocabulary does not depend on the trigger count
    except ValueError:
        raise ValueError(f"tokenizer {spec!r}: expected 'backcopy:<corpus|random>:<vocab>'") from None
    return t.tokenizer()


class BackcopySource:
    """Sequences of seq_len + 1 tokens of the task for one split, an endless stream addressed by sequence id (the
    trainer's source protocol: take, rows, state_dict, load_state_dict, epoch, key)."""

    def __init__(self, bc: BackcopyConfig, split: str, seq_len: int, seed: int):
        self.task, self.T, self.split = task_of(bc), seq_len, split
        self.seed = seed if split == "train" else 0  # validation: the same held-out sequences for every run
        self.task.sequences(split, self.seed, [], 1)  # refuses an unknown split now, not at the first batch
        self.key = f"backcopy:{self.task.key}:{split}:{self.seed}:{seq_len}"
        self.position = 0

    def rows(self, ids: np.ndarray) -> torch.Tensor:
        """(len(ids), T + 1) int64 sequences with the given ids."""
        return self.task.sequences(self.split, self.seed, ids, self.T + 1)

    def take(self, count: int, *, single_epoch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        ids = np.arange(self.position, self.position + count, dtype=np.int64)
        self.position += count
        return self.rows(ids), torch.from_numpy(ids)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "backcopy", "position": self.position, "key": self.key}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "backcopy" or state.get("key") != self.key:
            raise ValueError("the checkpoint's data position belongs to a different backcopy task, split, seed or "
                             "seq_len; resume with the run's original data settings")
        self.position = int(state["position"])

    def epoch(self) -> int:
        return 0  # endless: every id is a new sequence
