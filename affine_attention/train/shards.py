"""Pre-tokenised token shards (what `affine-attention prepare-data` writes) and the trainer's reader of them, the
`kind = "tokens"` source: sequences cut from the memory-mapped shards by id, no tokenisation at training time.

A prepared folder holds shard-NNNNN.npy (a flat uint16 or uint32 array: the documents' tokens, each followed by the
separator), shard-NNNNN.docs.npy (int64 end offset of every document within its shard) and manifest.json (format,
tokenizer spec and fingerprint, separator id, source identity, dtype, documents per shard, and per shard its file
names, token and document counts, byte sizes and sha256 sums). Shard k holds documents [k D, (k + 1) D) of the source
(D = documents per shard), so shards can be written, checked and resumed one by one. The concatenated shards are the
same stream as the in-memory path's (data.token_stream), and sequence i is stream[i T : i T + T + 1] as there.
"""
from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._files import atomic_write_bytes, atomic_write_json, notice_unlisted, read_json, require_keys, unlisted
from .packed import PackedArray
from .pretrained import tokenizer_fingerprint

FORMAT = 1
MANIFEST = "manifest.json"
HASH_CHUNK = 16 << 20  # bytes read per sha256 update: bounded memory for shards of any size


def token_dtype(vocab: int) -> np.dtype:
    """The smallest unsigned type holding every id of a `vocab`-token vocabulary."""
    return np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)


def shard_names(k: int) -> tuple[str, str]:
    """(token file, document index file) of shard k."""
    return f"shard-{k:05d}.npy", f"shard-{k:05d}.docs.npy"


def rebuild_hint(folder: Path) -> str:
    return (f"rebuild it with `affine-attention prepare-data --config <the config that built it> --out {folder}` "
            "(finished shards are checked and kept, damaged or missing ones rewritten)")


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def write_shard(folder: Path, k: int, tokens: np.ndarray, doc_ends: np.ndarray) -> dict[str, Any]:
    """Write shard k atomically: tokens (N,) in the token dtype and doc_ends (D,) int64; returns its manifest entry."""
    entry: dict[str, Any] = {"tokens": int(len(tokens)), "documents": int(len(doc_ends))}
    for key, name, array in zip(("file", "index"), shard_names(k), (tokens, doc_ends.astype(np.int64))):
        data = _npy_bytes(array)
        atomic_write_bytes(folder / name, data)
        entry[key] = {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return entry


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_size(folder: Path, meta: dict[str, Any]) -> Path:
    """The path of a shard file whose size is what the manifest says; else ValueError naming it."""
    path = folder / meta["name"]
    if not path.is_file():
        raise ValueError(f"prepared data: {path} is missing; {rebuild_hint(folder)}")
    size = path.stat().st_size
    if size != meta["bytes"]:
        raise ValueError(f"prepared data: {path} has {size} bytes, the manifest says {meta['bytes']} (truncated or "
                         f"overwritten); {rebuild_hint(folder)}")
    return path


def check_checksum(folder: Path, meta: dict[str, Any]) -> None:
    """Size, then sha256 of a shard file against the manifest; ValueError naming the file on a mismatch."""
    path = check_size(folder, meta)
    if file_sha256(path) != meta["sha256"]:
        raise ValueError(f"prepared data: {path} does not match its sha256 in {folder / MANIFEST} (damaged); "
                         f"{rebuild_hint(folder)}")


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise ValueError(f"{folder} holds no prepared data ({MANIFEST} missing); prepare it with "
                         f"`affine-attention prepare-data --config <config> --out {folder}`")
    fix = rebuild_hint(folder)
    manifest = require_keys(read_json(path, fix), str(path), {"format": int}, fix)
    if manifest["format"] != FORMAT:
        raise ValueError(f"{path}: format {manifest['format']!r}, this version reads {FORMAT}; {fix}")
    require_keys(manifest, str(path), {"tokenizer": str, "tokenizer_fingerprint": str, "separator_id": int,
                                       "dtype": str, "complete": bool, "shards": list}, fix)
    for k, shard in enumerate(manifest["shards"]):
        where = f"{path}: shard {k}"
        require_keys(shard, where, {"tokens": int, "documents": int, "file": dict, "index": dict}, fix)
        for part in ("file", "index"):
            meta = require_keys(shard[part], f"{where} {part!r}", {"name": str, "bytes": int, "sha256": str}, fix)
            if Path(meta["name"]).name != meta["name"] or meta["name"] in ("", ".", ".."):
                raise ValueError(f"{where} names {meta['name']!r}, not a file of the folder; {fix}")
    return manifest


def listed_names(manifest: dict[str, Any]) -> list[str]:
    """The shard files a prepared folder's manifest lists: the only files read from it."""
    return [s[part]["name"] for s in manifest["shards"] for part in ("file", "index")]


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    atomic_write_json(folder / MANIFEST, manifest)


def data_key(manifest: dict[str, Any]) -> str:
    """What identifies the token stream (tokenizer, separator and every shard's bytes): the sequence-id namespace."""
    blob = {"tok": manifest["tokenizer_fingerprint"], "sep": manifest["separator_id"],
            "shards": [s["file"]["sha256"] for s in manifest["shards"]]}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


class TokenSource(PackedArray):
    """Packed sequences of a prepared folder, by id (the PackedArray order and position: one integer, so a resume
    costs O(1)); rows are sliced out of memory-mapped shards, so a rank touches only the rows it reads.

    Opening checks the manifest, the tokenizer (its fingerprint), the separator and every shard file's size and npy
    header; `verify(shards)` checks sha256 sums (TrainBatches hands each rank its share, see data.py)."""

    kind = "tokens"

    def __init__(self, folder: str | Path, tok, sep: int, seq_len: int, seed: int, shuffle: bool):
        self.folder = folder = Path(folder).expanduser()
        m = self.manifest = read_manifest(folder)
        if not m.get("complete"):
            raise ValueError(f"{folder}: the preparation is unfinished ({len(m['shards'])} shards so far); finish it "
                             f"with `affine-attention prepare-data --config <config> --out {folder}`")
        if m["tokenizer_fingerprint"] != tokenizer_fingerprint(tok):
            raise ValueError(f"{folder / MANIFEST}: prepared with tokenizer {m['tokenizer']!r}, which is not the run's "
                             "tokenizer (fingerprints differ); set data.tokenizer to the one it was prepared with, "
                             f"or prepare again with the run's config into a new folder")
        if m["separator_id"] != sep:
            raise ValueError(f"{folder / MANIFEST}: prepared with separator id {m['separator_id']}, the run uses {sep} "
                             "(data.separator); set it as prepared or prepare again into a new folder")
        notice_unlisted(folder, unlisted(folder, listed_names(m), own=(MANIFEST,)), MANIFEST)
        self.maps = [self._open(s) for s in m["shards"]]
        sizes = np.asarray([len(x) for x in self.maps], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])  # (shards + 1,) stream offset of each shard
        self.tokens = None  # never the whole stream in memory: rows() slices the shards
        self.verified: set[int] = set()
        super().__init__(int(self.offsets[-1]), seq_len, seed, shuffle, key=f"{data_key(m)}:{seq_len}")

    def _open(self, shard: dict[str, Any]) -> np.memmap:
        path = check_size(self.folder, shard["file"])
        check_size(self.folder, shard["index"])
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as err:
            raise ValueError(f"prepared data: {path} is not a readable .npy file ({err}); "
                             f"{rebuild_hint(self.folder)}") from None
        if array.dtype != np.dtype(self.manifest["dtype"]) or array.shape != (shard["tokens"],):
            raise ValueError(f"prepared data: {path} holds {array.dtype} {array.shape}, the manifest says "
                             f"{self.manifest['dtype']} ({shard['tokens']},); {rebuild_hint(self.folder)}")
        return array

    def verify(self, shards) -> None:
        """sha256 of the given shards (token and index files) against the manifest, each at most once."""
        for k in shards:
            if k not in self.verified:
                for part in ("file", "index"):
                    check_checksum(self.folder, self.manifest["shards"][k][part])
                self.verified.add(k)

    def shards_of(self, ids: np.ndarray) -> list[int]:
        """The shards that the sequences with these ids read."""
        starts = np.asarray(ids, dtype=np.int64) * self.T
        first = np.searchsorted(self.offsets, starts, side="right") - 1
        last = np.searchsorted(self.offsets, starts + self.T, side="right") - 1
        return sorted({int(k) for a, b in zip(first, last) for k in range(a, b + 1)})

    def rows(self, ids: np.ndarray) -> torch.Tensor:
        """(len(ids), T + 1) int64 tokens of the given sequence ids, sliced from the shards (a sequence may span
        two or more of them)."""
        out = np.empty((len(ids), self.T + 1), dtype=np.int64)
        for r, i in enumerate(np.asarray(ids, dtype=np.int64)):
            pos, end = int(i) * self.T, int(i) * self.T + self.T + 1
            k, filled = int(np.searchsorted(self.offsets, pos, side="right") - 1), 0
            while pos < end:
                stop = min(end, int(self.offsets[k + 1]))
                out[r, filled:filled + stop - pos] = self.maps[k][pos - self.offsets[k]:stop - self.offsets[k]]
                filled, pos, k = filled + stop - pos, stop, k + 1
        return torch.from_numpy(out)
