"""A fixed list of packed sequences over one token stream, visited in per-epoch permutations drawn from (seed, epoch):
the order and resumable position shared by the in-memory sources (data.py) and prepared token shards (shards.py)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch


class PackedArray:
    """Sequence i is tokens[i T : i T + T + 1]; the position is one integer (sequences consumed), so a resume costs
    O(1) whatever the run consumed. Subclasses that keep the stream elsewhere override `rows`."""

    kind = "array"  # names the position's owner in checkpoints

    def __init__(self, tokens, seq_len: int, seed: int, shuffle: bool, key: str):
        """tokens: (N,) integer array, or N itself for a subclass that slices its own storage in `rows`."""
        if not isinstance(tokens, (int, np.integer)):
            self.tokens = tokens
        n_tokens = int(tokens) if isinstance(tokens, (int, np.integer)) else len(tokens)
        self.T, self.seed, self.shuffle, self.key = seq_len, seed, shuffle, key
        self.n = (n_tokens - 1) // seq_len
        if self.n < 1:
            raise ValueError(f"the data has {n_tokens} tokens, fewer than one sequence of {seq_len + 1}")
        self.position = 0  # sequences consumed
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = (np.random.default_rng([self.seed, epoch]).permutation(self.n) if self.shuffle
                          else np.arange(self.n))
            self._perm_epoch = epoch
        return self._perm

    def rows(self, ids: np.ndarray) -> torch.Tensor:
        """(len(ids), T + 1) int64 tokens of the given sequence ids."""
        starts = ids.astype(np.int64) * self.T
        idx = starts[:, None] + np.arange(self.T + 1)[None, :]
        return torch.from_numpy(self.tokens[idx].astype(np.int64))

    def take_ids(self, count: int) -> np.ndarray:
        """The ids (count,) int64 of the next `count` sequences (no tokens read: a rank reads only its own rows)."""
        g = np.arange(self.position, self.position + count, dtype=np.int64)
        ids = np.empty(count, dtype=np.int64)
        for epoch in np.unique(g // self.n):  # a batch may straddle an epoch boundary
            sel = g // self.n == epoch
            ids[sel] = self._order(int(epoch))[g[sel] % self.n]
        self.position += count
        return ids

    def take(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next `count` sequences: tokens (count, T + 1) int64 and their ids (count,) int64."""
        ids = self.take_ids(count)
        return self.rows(ids), torch.from_numpy(ids)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "position": self.position, "n": self.n, "key": self.key}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind or state.get("key") != self.key or state.get("n") != self.n:
            raise ValueError("the checkpoint's data position belongs to different data (tokenizer, text or "
                             "seq_len changed); resume with the run's original data settings")
        self.position = int(state["position"])

    def epoch(self) -> int:
        return self.position // self.n
