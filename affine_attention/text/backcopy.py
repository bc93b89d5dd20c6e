"""The Bigram-Backcopy task (Guo et al. 2024, "Active-Dormant Attention Heads", arXiv 2410.13835): its token chain,
its sequences and which queries are triggers. Training reads it through train/data_backcopy.py, the analysis
through analysis/sink_probe.py; it lives here, on the lowest floor, so both draw the very same sequences.

Every sequence starts with BOS (id 0). Tokens then follow a fixed bigram (Markov) chain, except after one of the k
trigger tokens, where the next token copies the token before the trigger. A model solves it with one head that is
*active* on trigger queries (it attends to the previous token) and *dormant* elsewhere, where the bigram needs no
attention at all: the smallest known setting in which softmax parks the dormant queries on BOS (an attention sink).
`BackcopyTask.trigger_mask` says which queries are active (their input token is a trigger: the next token is a
copy). The chain comes from the embedded corpus's bigram statistics or from a seeded random sparse matrix.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .._files import atomic_file

__all__ = ["BOS", "BackcopyTask", "task", "SPLITS"]

BOS = "<bos>"
SPLITS = {"train": 0, "validation": 1}
CACHE_DIR = Path("~/.cache/affine_attention/backcopy")  # the tokenised corpus behind the corpus chain


@dataclass(frozen=True, eq=False)
class BackcopyTask:
    """names[i]: the string of token i (0 = BOS); probs: (V + 1, V + 1) rows of the bigram chain, row 0 the
    distribution of the first token after BOS (triggers excluded, so a copy never reaches back to BOS); triggers:
    the trigger token ids; key: a hash of all of it (resume and cache checks)."""

    names: tuple[str, ...]
    probs: np.ndarray
    triggers: tuple[int, ...]
    key: str

    @property
    def vocab_size(self) -> int:
        return len(self.names)

    def sample(self, generators: list[np.random.Generator], length: int) -> np.ndarray:
        """(len(generators), length) int64 sequences, one per generator (its uniforms drive only its row)."""
        n = len(generators)
        u = np.stack([g.random(length) for g in generators]) if n else np.zeros((0, length))
        cum = np.cumsum(self.probs, axis=1)
        cum[:, -1] = 1.0  # rounding: a uniform just below 1 must still pick the last token
        trig = np.zeros(self.vocab_size, dtype=bool)
        trig[list(self.triggers)] = True
        x = np.zeros((n, length), dtype=np.int64)  # column 0 stays BOS
        for t in range(1, length):
            drawn = (cum[x[:, t - 1]] < u[:, t:t + 1]).sum(1)
            x[:, t] = np.where(trig[x[:, t - 1]] & (t >= 2), x[:, max(t - 2, 0)], drawn)
        return x

    def trigger_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """(..., T) bool: True where the input token is a trigger, i.e. the query whose next token is a copy."""
        return torch.isin(ids, torch.tensor(self.triggers, device=ids.device))

    def bigram_entropy(self, ids: torch.Tensor) -> torch.Tensor:
        """(..., T) float64: the entropy (nats) of the chain's next-token distribution after each token: the lowest
        expected loss any model can reach on a bigram position (0 is returned on triggers, whose next token is
        determined)."""
        p = torch.from_numpy(self.probs)
        h = -(p * torch.log(p.clamp_min(1e-300))).sum(1)
        out = h[ids.cpu()]
        return torch.where(self.trigger_mask(ids.cpu()), torch.zeros_like(out), out)

    def sequences(self, split: str, seed: int, ids, length: int) -> torch.Tensor:
        """(len(ids), length) int64: sequence `i` of `split` for run seed `seed`, for each i in ids. Each draws from
        its own generator seeded by (task, split, seed, i), so a sequence never depends on its batch."""
        if split not in SPLITS:
            raise ValueError(f"a backcopy split is 'train' or 'validation', got {split!r}")
        base = int(self.key, 16) % 2**63
        gens = [np.random.default_rng([base, SPLITS[split], int(seed), int(i)]) for i in ids]
        return torch.from_numpy(self.sample(gens, length))

    def tokenizer(self):
        """A fast word-level tokenizer over `names` (BOS doubles as eos, pad and unk: the task has no other
        specials), so checkpoints carry a tokenizer that decodes the task's ids."""
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        tk = Tokenizer(models.WordLevel({n: i for i, n in enumerate(self.names)}, unk_token=BOS))
        tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=BOS, eos_token=BOS, pad_token=BOS,
                                       unk_token=BOS)


def task(transitions: str = "corpus", vocab: int = 64, triggers: int = 3, branching: int = 8,
         seed: int = 0) -> BackcopyTask:
    """The task of these settings (the keys of a run config's [data.backcopy] table); cached per process, and the
    corpus statistics on disk, since they take a tokenised corpus."""
    if transitions not in ("corpus", "random"):
        raise ValueError(f"data.backcopy.transitions must be 'corpus' or 'random', got {transitions!r}")
    if not 1 <= triggers < vocab:
        raise ValueError(f"data.backcopy.triggers ({triggers}) must be in [1, data.backcopy.vocab = {vocab})")
    seed = seed if transitions == "random" else 0  # the corpus chain has no randomness
    branching = branching if transitions == "random" else 0
    return _task(transitions, vocab, triggers, branching, seed)


@functools.lru_cache(maxsize=8)
def _task(transitions: str, vocab: int, k: int, branching: int, seed: int) -> BackcopyTask:
    if transitions == "corpus":
        names, chain, freq = _corpus_chain(vocab)
    else:
        names, chain, freq = _random_chain(vocab, branching, seed)
    # Triggers: the k most frequent tokens (ties broken by id), as in the paper, so copies are common.
    triggers = tuple(sorted(int(i) + 1 for i in np.argsort(-freq, kind="stable")[:k]))
    probs = np.zeros((vocab + 1, vocab + 1))
    probs[1:, 1:] = chain
    start = freq.astype(np.float64).copy()
    start[[t - 1 for t in triggers]] = 0.0
    probs[0, 1:] = start / start.sum()
    h = hashlib.sha256(repr((names, triggers)).encode())
    h.update(np.ascontiguousarray(probs).tobytes())
    return BackcopyTask(tuple([BOS, *names]), probs, triggers, h.hexdigest()[:16])


def _corpus_chain(vocab: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The bigram chain of the `vocab` most frequent tokens of the embedded corpus (train split, packaged tokenizer):
    transition counts between consecutive tokens that are both among them, row-normalised; a row that never
    occurs becomes uniform."""
    from .corpus import corpus_texts, default_tokenizer

    tok = default_tokenizer()
    texts = corpus_texts("train")
    h = hashlib.sha256(tok.backend_tokenizer.to_str().encode())
    for t in texts:
        h.update(hashlib.sha256(t.encode()).digest())
    cache = CACHE_DIR.expanduser() / f"corpus-stream-{h.hexdigest()[:24]}.npy"
    if cache.is_file():
        stream = np.load(cache, allow_pickle=False)
    else:
        ids = tok(texts, add_special_tokens=False, verbose=False)["input_ids"]
        stream = np.concatenate([np.asarray(x + [tok.eos_token_id], dtype=np.int64) for x in ids])
        cache.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(cache) as f:  # readers never see half a file
            np.save(f, stream, allow_pickle=False)
    counts = np.bincount(stream, minlength=len(tok)).astype(np.float64)
    counts[list(tok.all_special_ids)] = 0  # separators are not words
    top = np.argsort(-counts, kind="stable")[:vocab]
    index = np.full(len(tok), -1, dtype=np.int64)
    index[top] = np.arange(vocab)
    a, b = index[stream[:-1]], index[stream[1:]]
    keep = (a >= 0) & (b >= 0)
    pair = np.zeros((vocab, vocab))
    np.add.at(pair, (a[keep], b[keep]), 1.0)
    rows = pair.sum(1, keepdims=True)
    chain = np.where(rows > 0, pair / np.maximum(rows, 1), 1.0 / vocab)
    names = tok.convert_ids_to_tokens([int(i) for i in top])
    return names, chain, counts[top]


def _random_chain(vocab: int, branching: int, seed: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """A seeded sparse chain: each token has min(branching, vocab) successors with Dirichlet(1) weights; token
    frequencies are the chain's stationary distribution (power iteration)."""
    rng = np.random.default_rng([seed, 7])
    chain = np.zeros((vocab, vocab))
    b = min(branching, vocab)
    for i in range(vocab):
        chain[i, rng.choice(vocab, size=b, replace=False)] = rng.dirichlet(np.ones(b))
    pi = np.full(vocab, 1.0 / vocab)
    for _ in range(500):
        pi = 0.5 * pi + 0.5 * pi @ chain  # lazy walk: converges even on periodic chains
    return [f"w{i + 1}" for i in range(vocab)], chain, pi
