"""Training data: documents -> tokens -> packed sequences of seq_len + 1 tokens, deterministic and resumable.

Packing: every document is tokenised without special tokens and followed by the separator (eos unless
data.separator names another token), and the documents are concatenated into one stream. Sequence i is
stream[i*T : i*T + T + 1] (T = seq_len): its first T tokens are the inputs and its last T the targets, so
consecutive sequences share one token and every stream token after the first is predicted exactly once. Attention is not blocked at separators (standard packing).

Three kinds of source:
- in memory (`corpus`, `files`): the whole stream is tokenised once (cached as an .npy keyed by the tokenizer
  and a hash of the text), cut into a fixed list of sequences, and each epoch visits them in a permutation drawn
  from (seed, epoch) (packed.py). The position is a single integer: sequences consumed so far.
- prepared (`tokens`: a folder written by `affine-attention prepare-data`, shards.py): the same, read from
  memory-mapped token shards, so nothing is tokenised or held in memory at training time.
- streamed (`hub`: a `datasets` hub name or builder, read with streaming=True): documents in source order, no
  shuffling; the position is (epoch, documents consumed, unemitted tokens, sequences emitted in the epoch), and a
  resume skips the consumed documents. Each epoch starts from an empty buffer, so every epoch yields the same
  sequences. Under several ranks each rank streams its own documents (TrainBatches).
Every sequence has an id (its index in the fixed list, or its index within the epoch for streams): the KD teacher
cache is keyed by it. Ranks read their own rows of one global batch (TrainBatches), so for every source but a
rank-split stream the data order and the result do not depend on the number of ranks.
"""
from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._files import atomic_file, atomic_write_bytes
from ..text import documents as text_documents
from ..text import encode_documents
from .config import DataConfig, SourceConfig
from .packed import PackedArray
from .prefetch import Prefetcher
from .pretrained import tokenizer_fingerprint

TOKENIZE_BATCH = 32  # documents per tokenizer call
# The version of how documents become tokens (tokenize_documents), in every key of tokenised data: bump it when
# that changes, and caches made the old way are rebuilt instead of read.
TOKENS_FORMAT = 2


# --- documents -------------------------------------------------------------------------------------------------

def documents(src: SourceConfig, skip: int = 0, rank: int = 0, world: int = 1) -> Iterator[str]:
    """The documents of a source in their fixed order, after skipping the first `skip` (see text.documents; a hub
    stream with world > 1: only the documents of `rank`)."""
    return text_documents(src.kind, split=src.split, paths=src.paths, text_field=src.text_field, name=src.name,
                          subset=src.subset, revision=src.revision, skip=skip, rank=rank, world=world)


def separator_id(tok, separator: str = "") -> int:
    """Id of the document separator: `separator` when given (it must be one token of the vocabulary), else eos."""
    if not separator:
        return tok.eos_token_id
    sep = tok.convert_tokens_to_ids(separator)
    if sep is None or tok.convert_ids_to_tokens(sep) != separator:  # unknown strings map to unk
        raise ValueError(f"data.separator {separator!r} is not a token of the tokenizer; use one of its special "
                         f"tokens, e.g. {tok.eos_token!r}, or leave it empty for eos")
    return sep


def tokenize_documents(tok, docs: list[str], sep: int) -> list[list[int]]:
    """Token ids of each document as text (text.encode_documents: a special token's string in it stays text), each
    followed by the separator id `sep`, the only separator in the stream."""
    return [x + [sep] for x in encode_documents(tok, docs)]


def source_identity(src: SourceConfig) -> dict[str, Any]:
    """What identifies a streamed source in cache keys (in-memory sources are keyed by a hash of their text)."""
    return {"kind": src.kind, "name": src.name, "subset": src.subset, "split": src.split, "revision": src.revision,
            "paths": list(src.paths), "text_field": src.text_field}


def source_content(src: SourceConfig) -> dict[str, Any]:
    """What a source's documents are read from, beyond its settings (for what is resumed or kept across runs: a
    prepared folder, a stream position): every local file its paths match, in order, with its size and sha256 (a
    glob that matches one more file changes the list), or the packaged corpus's text. A hub dataset read by name
    has only its revision (pin data.<source>.revision to make it fixed): its content cannot be read ahead."""
    from ..text import corpus_texts
    from ..text.read import expand
    from .shards import file_sha256

    if src.kind == "corpus":
        h = hashlib.sha256()
        for text in corpus_texts(src.split):
            h.update(hashlib.sha256(text.encode()).digest())
        return {"corpus_sha256": h.hexdigest()}
    try:
        files = expand(src.paths) if src.paths else []
    except ValueError:
        if src.kind == "files":
            raise
        files = []  # a hub builder's remote data files
    if not files:
        return {"revision": src.revision}
    return {"files": [[str(p), p.stat().st_size, file_sha256(p)] for p in files]}


def content_change(old: dict[str, Any] | None, new: dict[str, Any]) -> str:
    """What differs between two `source_content` records, in words (files added, removed or edited)."""
    if not old or "files" not in old or "files" not in new:
        return f"{old} then, {new} now"
    before, now = {f[0]: f[1:] for f in old["files"]}, {f[0]: f[1:] for f in new["files"]}
    parts = [f"{what}: {names[:3]}" for what, names in (
        ("added", [n for n in now if n not in before]), ("removed", [n for n in before if n not in now]),
        ("edited", [n for n in now if n in before and now[n] != before[n]])) if names]
    return "; ".join(parts) or "the files' order changed"


# --- in-memory sources -----------------------------------------------------------------------------------------

def token_stream(src: SourceConfig, tok, cache_dir: str, sep: int) -> tuple[np.ndarray, str]:
    """(tokens int32 (N,), key) for an in-memory source; the key hashes the tokenizer, the separator and every
    document's text."""
    docs = list(documents(src))
    if not docs:
        raise ValueError(f"data source {source_identity(src)} has no documents")
    h = hashlib.sha256(f"{TOKENS_FORMAT}:{tokenizer_fingerprint(tok)}:{sep}".encode())
    for d in docs:
        h.update(hashlib.sha256(d.encode()).digest())
    key = h.hexdigest()
    path = Path(cache_dir).expanduser() / f"{key}.npy" if cache_dir else None
    if path is not None and path.is_file():
        cached = _read_token_cache(path)
        if cached is not None:
            return cached, key
    chunks = []
    for i in range(0, len(docs), TOKENIZE_BATCH):
        chunks.extend(np.asarray(x, dtype=np.int32) for x in tokenize_documents(tok, docs[i:i + TOKENIZE_BATCH], sep))
    tokens = np.concatenate(chunks)
    if path is not None:  # write-then-rename: a concurrent reader never sees half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as f:
            np.save(f, tokens, allow_pickle=False)
            atomic_write_bytes(_checksum_path(path), _token_digest(tokens).encode())  # before the tokens appear
    return tokens, key


def _checksum_path(path: Path) -> Path:
    return path.with_suffix(".sha256")


def _token_digest(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()


def _read_token_cache(path: Path) -> np.ndarray | None:
    """The cached tokens (N,) int32, checked against the checksum written beside them; None, with a notice on
    stderr, when the file is truncated, damaged or has no checksum (an older cache): the caller rebuilds it."""
    try:
        tokens = np.load(path, allow_pickle=False)
        ok = _token_digest(tokens) == _checksum_path(path).read_text().strip()
        reason = "its checksum does not match"
    except (OSError, ValueError, EOFError) as err:
        ok, reason = False, f"{type(err).__name__}: {err}"
    if ok:
        return tokens
    print(f"notice: token cache {path} is unusable ({reason}); rebuilding it", file=sys.stderr, flush=True)
    return None


# --- streamed sources ------------------------------------------------------------------------------------------

class PackedStream:
    """Packed sequences from a streamed source, in source order; resumable from (epoch, docs, buffer, seq).

    Split by rank (`split_by_rank`, TrainBatches does it under torchrun), each rank reads and packs only its own
    documents, and sequence s of rank r in an epoch gets the id s W + r, unique over the ranks for the KD cache."""

    def __init__(self, src: SourceConfig, tok, seq_len: int, sep: int):
        self.src, self.tok, self.T, self.sep = src, tok, seq_len, sep
        self.content = source_content(src)  # in the position's key: a resume never continues in other data
        self.split_by_rank(0, 1)

    def split_by_rank(self, rank: int, world: int) -> None:
        """Read only the documents of `rank` out of `world` ranks, from the start of the stream."""
        self.rank, self.world = rank, world
        ident = {"src": source_identity(self.src), "tok": tokenizer_fingerprint(self.tok), "sep": self.sep,
                 "content": self.content}
        if world > 1:  # the ids and sequences depend on the number of ranks
            ident["world"] = world
        self.key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
        self._state = {"epoch": 0, "docs": 0, "buffer": [], "seq": 0}
        self._docs: Iterator[str] | None = None

    def _fill(self) -> bool:
        """Tokenise the next documents into the buffer; False when the epoch's documents are exhausted."""
        if self._docs is None:
            self._docs = documents(self.src, skip=self._state["docs"], rank=self.rank, world=self.world)
        batch = []
        for doc in self._docs:
            batch.append(doc)
            if len(batch) == TOKENIZE_BATCH:
                break
        if not batch:
            return False
        for ids in tokenize_documents(self.tok, batch, self.sep):
            self._state["buffer"].extend(ids)
        self._state["docs"] += len(batch)
        return True

    def take(self, count: int, *, single_epoch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        rows, ids, s = [], [], self._state
        while len(rows) < count:
            if len(s["buffer"]) >= self.T + 1:
                rows.append(s["buffer"][: self.T + 1])
                ids.append(s["seq"] * self.world + self.rank)
                del s["buffer"][: self.T]  # the last token starts the next sequence
                s["seq"] += 1
                continue
            if self._fill():
                continue
            if s["seq"] == 0 or single_epoch:
                raise ValueError(f"data source {source_identity(self.src)} holds only {s['seq']} sequences of "
                                 f"{self.T + 1} tokens, {count - len(rows)} too few")
            # Epoch end: the partial buffer is dropped so every epoch yields the same sequences.
            self._state = s = {"epoch": s["epoch"] + 1, "docs": 0, "buffer": [], "seq": 0}
            self._docs = None
        return torch.tensor(rows, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "stream", "key": self.key, **{k: (list(v) if k == "buffer" else v)
                                                      for k, v in self._state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "stream" or state.get("key") != self.key:
            raise ValueError("the checkpoint's data position belongs to a different data source or tokenizer")
        self._state = {k: (list(state[k]) if k == "buffer" else int(state[k])) for k in ("epoch", "docs", "buffer",
                                                                                           "seq")}
        self._docs = None

    def epoch(self) -> int:
        return self._state["epoch"]


# --- what the trainer uses -------------------------------------------------------------------------------------

def open_source(src: SourceConfig, tok, cfg: DataConfig, seed: int, *, shuffle: bool):
    """A PackedArray (corpus, files), TokenSource (tokens: a prepared folder, shards.py), PackedStream (hub) or
    BackcopySource (backcopy: generated, not packed)."""
    if src.kind == "backcopy":
        from .data_backcopy import BackcopySource

        return BackcopySource(cfg.backcopy, src.split, cfg.seq_len, seed)
    sep = separator_id(tok, cfg.separator)
    if src.kind == "tokens":
        from .shards import TokenSource

        return TokenSource(src.paths[0], tok, sep, cfg.seq_len, seed, shuffle)
    if src.kind == "hub":
        return PackedStream(src, tok, cfg.seq_len, sep)
    tokens, key = token_stream(src, tok, cfg.token_cache_dir, sep)
    return PackedArray(tokens, cfg.seq_len, seed, shuffle, key=f"{key}:{cfg.seq_len}")


def data_key(source, seq_len: int) -> str:
    """Identifies the sequence-id space of a source (the KD cache namespace): same key, same sequence per id."""
    return hashlib.sha256(f"{source.key}:{seq_len}".encode()).hexdigest()


def eval_sequences(src: SourceConfig, tok, cfg: DataConfig, count: int) -> torch.Tensor:
    """The first `count` sequences of `src` in order: (count, T + 1) int64 (held-out loss and probe batch)."""
    source = open_source(src, tok, cfg, seed=0, shuffle=False)
    if src.kind == "backcopy":
        return source.rows(np.arange(count))
    if isinstance(source, PackedArray):
        if count > source.n:
            raise ValueError(f"data.eval_sequences = {count} but the eval source holds only {source.n} sequences "
                             f"of {cfg.seq_len + 1} tokens")
        if hasattr(source, "verify"):  # prepared shards: checksums of the few it reads
            source.verify(source.shards_of(np.arange(count)))
        return source.rows(np.arange(count))
    return source.take(count, single_epoch=True)[0]


PREFETCH_BATCHES = 2  # global batches read ahead per rank: one in use, the next ready; memory stays bounded


class TrainBatches:
    """Global batches for the trainer. Every rank draws the same global batch of G rows. A step runs A = G / (m W)
    accumulation rounds (m = micro_batch, W = ranks); round i covers global rows [i m W, (i + 1) m W) and rank r takes
    the r-th m rows of it. So each forward round sees the same rows for any W with the same m W: a single process
    with micro_batch = m W reproduces W ranks exactly, including alpha_ma, which is updated once per forward round
    from the mean over all ranks' rows.

    Sources that hand out ids (`take_ids`: in-memory, prepared shards) are read rank-locally: every rank draws the
    global batch's ids (cheap) and reads only its own rows. A hub stream under W > 1 ranks is split by rank instead
    (each rank streams, tokenises and packs only its own documents, so its batches depend on W, and a checkpoint
    holds every rank's position); backcopy produces the whole global batch on every rank. A background thread
    (prefetch.py) reads the next batches ahead; the position saved is that after the last batch a step used. A
    prepared source's shards are checksummed at the start, each rank a share (shard k by rank k mod W).
    """

    def __init__(self, source, global_batch: int, micro_batch: int, rank: int, world: int):
        if global_batch % (micro_batch * world):
            raise ValueError(f"train.global_batch ({global_batch}) must be a multiple of train.micro_batch "
                             f"({micro_batch}) x ranks ({world})")
        self.source, self.global_batch, self.micro, self.rank, self.world = source, global_batch, micro_batch, rank, world
        rounds = global_batch // (micro_batch * world)
        self.rows = torch.tensor([i * micro_batch * world + rank * micro_batch + j
                                  for i in range(rounds) for j in range(micro_batch)])
        self.rank_split = world > 1 and hasattr(source, "split_by_rank")
        if self.rank_split:
            source.split_by_rank(rank, world)
        if hasattr(source, "verify"):
            source.verify(range(rank, len(source.maps), world))
        self.prefetch = Prefetcher(self._read, source.state_dict, depth=PREFETCH_BATCHES)

    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rank_split:
            return self.source.take(self.global_batch // self.world)
        if hasattr(self.source, "take_ids"):
            ids = self.source.take_ids(self.global_batch)[self.rows.numpy()]
            return self.source.rows(ids), torch.from_numpy(ids)
        tokens, ids = self.source.take(self.global_batch)
        return tokens[self.rows], ids[self.rows]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the next global batch, micro-batch after micro-batch: tokens (L, T + 1) int64 and
        sequence ids (L,) int64, L = global_batch / ranks."""
        return self.prefetch.next()

    def state_dict(self) -> dict[str, Any]:
        """The position after the batches used; a rank-split stream gathers every rank's (a collective: call it on
        every rank)."""
        state = self.prefetch.state_dict()
        if not self.rank_split:
            return state
        import torch.distributed as dist

        states: list[Any] = [None] * self.world
        dist.all_gather_object(states, state)
        return {"kind": "ranks", "world": self.world, "ranks": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") == "ranks" or self.rank_split:
            if state.get("kind") != "ranks" or state.get("world") != self.world:
                raise ValueError(f"the checkpoint's data position was saved by {state.get('world', 1)} rank(s) and "
                                 f"this run has {self.world}: a hub stream is split by rank, so resume with the same "
                                 "number of ranks (or prepare the data with `affine-attention prepare-data`)")
            state = state["ranks"][self.rank]
        self.prefetch.close()
        self.source.load_state_dict(state)
        self.prefetch.reset()

    def close(self) -> None:
        """Stop reading ahead and put the source back at the position of the batches used."""
        self.prefetch.close()
        self.source.load_state_dict(self.prefetch.state_dict())
