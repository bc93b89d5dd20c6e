"""`affine-attention prepare-data`: tokenise a run's data source once, in parallel worker processes, into the token
shards that a `kind = "tokens"` source reads (format: shards.py); resumable shard by shard."""
from __future__ import annotations

import multiprocessing
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .config import RunConfig
from .._files import check_writable
from .data import (TOKENS_FORMAT, content_change, documents, separator_id, source_content, source_identity,
                   tokenize_documents)
from .shards import FORMAT, check_checksum, read_manifest, token_dtype, write_manifest, write_shard

CHUNK_DOCUMENTS = 256  # documents per worker task: large enough to amortise pickling, small enough to balance
PROGRESS_EVERY_S = 5.0
# What determines a preparation's shards; a folder prepared with any of them different is refused, naming it.
IDENTITY = ("format", "tokens_format", "tokenizer_fingerprint", "separator_id", "source", "content", "dtype",
            "shard_documents")

_worker: dict[str, Any] = {}  # the tokenizer of this worker process (loaded once per process by _init)


def _init(spec: str, sep: int, dtype: str) -> None:
    from .pretrained import load_tokenizer

    _worker.update(tok=load_tokenizer(spec), sep=sep, dtype=np.dtype(dtype))


def _tokenize(docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """tokens (N,) in the shard dtype (every document followed by the separator) and lengths (len(docs),) int64."""
    ids = tokenize_documents(_worker["tok"], docs, _worker["sep"])
    lengths = np.asarray([len(x) for x in ids], dtype=np.int64)
    return np.concatenate([np.asarray(x, dtype=_worker["dtype"]) for x in ids]), lengths


def document_count(src) -> int | None:
    """How many documents the source holds, when that is cheap to know (for the ETA); None for hub streams."""
    from ..text import corpus_texts
    from ..text.read import expand

    if src.kind == "corpus":
        return len(corpus_texts(src.split))
    if src.kind != "files":
        return None
    total = 0
    for path in expand(src.paths):
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            total += pq.ParquetFile(path).metadata.num_rows
        elif suffix in (".jsonl", ".json"):
            with open(path, "rb") as f:
                total += sum(1 for line in f if line.strip())
        else:
            total += 1
    return total


def _chunks(src, start_doc: int, shard_documents: int) -> Iterator[tuple[int, list[str]]]:
    """(shard, documents) chunks from document `start_doc` on, never spanning two shards."""
    chunk, shard, index = [], start_doc // shard_documents, start_doc
    for doc in documents(src, skip=start_doc):
        if index // shard_documents != shard:
            if chunk:
                yield shard, chunk
            chunk, shard = [], index // shard_documents
        chunk.append(doc)
        index += 1
        if len(chunk) == CHUNK_DOCUMENTS:
            yield shard, chunk
            chunk = []
    if chunk:
        yield shard, chunk


def _ordered(tasks: Iterator[tuple[int, list[str]]], workers: int, init_args: tuple) -> Iterator[tuple[int, int, Any]]:
    """(shard, documents, (tokens, lengths)) per chunk, in order; with workers > 1 tokenised in a process pool with
    at most 2 x workers chunks in flight (Pool.imap would read the whole source ahead into memory)."""
    if workers <= 1:
        _init(*init_args)
        for shard, docs in tasks:
            yield shard, len(docs), _tokenize(docs)
        return
    # spawn: workers start clean (no inherited torch or tokenizer threads) and load the tokenizer once each.
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_init, initargs=init_args) as pool:
        pending: deque = deque()
        for shard, docs in tasks:
            pending.append((shard, len(docs), pool.apply_async(_tokenize, (docs,))))
            if len(pending) >= 2 * workers:
                shard0, n0, res = pending.popleft()
                yield shard0, n0, res.get()
        while pending:
            shard0, n0, res = pending.popleft()
            yield shard0, n0, res.get()


class _Progress:
    """One line on stderr at most every PROGRESS_EVERY_S: documents, tokens, tokens/s and, when the size is
    known, the ETA."""

    def __init__(self, total: int | None, done: int):
        self.total, self.done, self.start_done, self.tokens = total, done, done, 0
        self.t0 = self.last = time.perf_counter()

    def update(self, docs: int, tokens: int, final: bool = False) -> None:
        self.done, self.tokens = self.done + docs, self.tokens + tokens
        now = time.perf_counter()
        if not final and now - self.last < PROGRESS_EVERY_S:
            return
        self.last, dt = now, max(now - self.t0, 1e-9)
        rate = (self.done - self.start_done) / dt
        if self.total:
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            where = f"{self.done:,}/{self.total:,} documents ({100 * self.done / self.total:.1f}%), ETA {eta:,.0f} s"
        else:
            where = f"{self.done:,} documents (size unknown: no ETA)"
        print(f"prepare-data: {where}, {self.tokens / 1e6:,.1f}M tokens this session, {self.tokens / dt / 1e6:.2f}M "
              f"tokens/s, {dt:.0f} s", file=sys.stderr, flush=True)


def _kept_shards(out: Path, identity: dict[str, Any], log) -> tuple[list[dict[str, Any]], bool]:
    """The finished shards of an earlier (interrupted or complete) preparation in `out` that pass their checksums,
    in order up to the first damaged one; refuses a folder prepared from other data or with another tokenizer."""
    if not (out / "manifest.json").is_file():
        return [], False
    old = read_manifest(out)
    changed = [k if k != "content" else f"the source's files ({content_change(old.get(k), identity[k])})"
               for k in IDENTITY if old.get(k) != identity[k]]
    if changed:
        raise ValueError(f"{out} holds data prepared with other settings or data ({', '.join(changed)} differ); use "
                         "another --out or delete that folder")
    kept = []
    for k, shard in enumerate(old["shards"]):
        try:
            check_checksum(out, shard["file"])
            check_checksum(out, shard["index"])
        except ValueError as err:
            log(f"prepare-data: {err}; rewriting from shard {k}")
            return kept, False
        kept.append(shard)
    return kept, bool(old.get("complete"))


def prepare(cfg: RunConfig, out: str | Path, *, which: str = "train", workers: int = 1,
            shard_documents: int = 100_000, log=print) -> dict[str, Any]:
    """Tokenise data.<which> of `cfg` into shards in `out`; returns the manifest. Rerunning on an interrupted folder
    keeps the shards that pass their checksums and continues after them; on a complete one it only verifies."""
    from .model import tokenizer_spec
    from .pretrained import load_tokenizer, tokenizer_fingerprint

    src = getattr(cfg.data, which)
    if src.kind in ("tokens", "backcopy"):
        raise ValueError(f"data.{which}.kind = {src.kind!r} has nothing to prepare; prepare-data reads corpus, "
                         "files or hub sources")
    if shard_documents < 1 or workers < 1:
        raise ValueError(f"--shard-documents and --workers must be >= 1, got {shard_documents} and {workers}")
    if not str(out).strip():
        raise ValueError("--out is empty; name the folder for the shards and manifest.json")
    out = Path(out).expanduser()
    check_writable(out)
    spec = tokenizer_spec(cfg)
    tok = load_tokenizer(spec)
    sep, dtype = separator_id(tok, cfg.data.separator), token_dtype(len(tok))
    identity = {"format": FORMAT, "tokens_format": TOKENS_FORMAT, "tokenizer_fingerprint": tokenizer_fingerprint(tok),
                "separator_id": sep, "source": source_identity(src), "content": source_content(src),
                "dtype": dtype.name, "shard_documents": shard_documents}
    manifest = {**identity, "tokenizer": spec, "separator": cfg.data.separator or tok.eos_token,
                "vocab": len(tok), "complete": False, "shards": []}
    out.mkdir(parents=True, exist_ok=True)
    kept, complete = _kept_shards(out, identity, log)
    manifest["shards"] = kept
    if complete:
        log(f"prepare-data: {out} is complete; all {len(kept)} shards match their sha256")
        return read_manifest(out)
    start = len(kept) * shard_documents
    if kept:
        log(f"prepare-data: keeping {len(kept)} finished shards of {out}, continuing at document {start:,}")
    write_manifest(out, manifest)
    progress = _Progress(document_count(src), start)
    tasks = _chunks(src, start, shard_documents)
    parts: list[tuple[np.ndarray, np.ndarray]] = []

    def flush(k: int) -> None:
        tokens = np.concatenate([t for t, _ in parts])
        ends = np.cumsum(np.concatenate([n for _, n in parts]))
        manifest["shards"].append(write_shard(out, k, tokens, ends))
        write_manifest(out, manifest)  # after the shard: a manifest never lists a shard that is not on disk
        parts.clear()

    shard = len(kept)
    for k, n_docs, (tokens, lengths) in _ordered(tasks, workers, (spec, sep, dtype.name)):
        if k != shard:
            flush(shard)
            shard = k
        parts.append((tokens, lengths))
        progress.update(n_docs, len(tokens))
    if parts:
        flush(shard)
    if not manifest["shards"]:
        raise ValueError(f"data source {source_identity(src)} has no documents")
    manifest["complete"] = True
    manifest["total_tokens"] = sum(s["tokens"] for s in manifest["shards"])
    write_manifest(out, manifest)
    progress.update(0, 0, final=True)
    log(f"prepare-data: {out}: {len(manifest['shards'])} shards, {manifest['total_tokens']:,} tokens "
        f"({dtype.name}); train on it with --set data.{which}.kind='tokens' --set \"data.{which}.paths=['{out}']\"")
    return manifest

