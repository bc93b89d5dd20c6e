"""On-disk cache of teacher top-k logits: safetensors shards keyed by sequence id, in a folder named by a hash of
(data, seq_len, teacher content, k, dtype), so every run that sees the same sequences with the same teacher reuses them.

Layout: <cache_dir>/<hash>/key.json (what the hash covers), teacher.json (the teacher's vocabulary fingerprint and
output size, so later runs check the student without loading the teacher), shards.jsonl (the manifest: one line per
shard, appended under a lock once the shard is on disk; only shards it lists are read, others are named) and
shard-*.safetensors, each holding ids (n,) int64, values (n, T, k) in the teacher's logits dtype and indices (n, T, k)
int32. Shards are written to a temporary name, fsynced and renamed, so a reader never sees a partial shard; several
ranks or runs may write concurrently (unique names; a sequence cached twice holds identical data). Rows are read
lazily (memory-mapped); each shard carries a sha256 of its tensors in its safetensors metadata and in the manifest,
checked when its first row is read. The teacher enters the key by content (`teacher_identity`), not by file dates.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from .._files import (atomic_path, atomic_write_bytes, atomic_write_json, log_records, notice_unlisted, read_json,
                      require_keys, unlisted)

SHARDS = "shards.jsonl"  # a cache folder's manifest
FIXED = ("key.json", "teacher.json", SHARDS)  # the files every cache folder has besides its shards
HASHES = "file-hashes.json"  # in the cache root: teacher files' sha256, memoised against (inode, size, mtime_ns)


def _content_sha256(path: Path, memo: dict[str, list]) -> str:
    """sha256 of the file at `path`, from `memo` when its (inode, size, mtime_ns) are those recorded there (an edit
    in place changes mtime_ns, a replacement the inode), else read and recorded."""
    st = path.stat()
    stamp = [st.st_ino, st.st_size, st.st_mtime_ns]
    known = memo.get(str(path.resolve()))
    if isinstance(known, list) and len(known) == 4 and known[:3] == stamp:
        return known[3]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    memo[str(path.resolve())] = [*stamp, h.hexdigest()]
    return h.hexdigest()


def teacher_identity(spec: str, root: str | Path) -> dict[str, Any]:
    """What names a teacher in the cache key: its spec and the sha256 of every file it is loaded from (a folder's
    config, weights, tokenizer and generation files; or its GGUF file), so an edited config.json (rms_norm_eps) or a
    retrained weights file is a new cache, and a file only touched or copied is not. Weights are hashed once per
    change: hashing multi-GB weights on every run would cost minutes, so each hash is memoised in <root>/HASHES
    against the file's (inode, size, mtime_ns). A hub name that is no local path is named by its spec alone (pin a
    revision: the files behind an unpinned name can change)."""
    from ..hf.load import resolve

    path, kwargs = resolve(spec)
    p = Path(path)
    files = [p / kwargs["gguf_file"]] if "gguf_file" in kwargs else sorted(
        f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")) if p.is_dir() else []
    ident: dict[str, Any] = {"spec": spec, **kwargs}
    if not files:
        return ident
    memo_path = Path(root).expanduser() / HASHES
    memo = read_json(memo_path, f"delete {memo_path} (the hashes are recomputed)") if memo_path.is_file() else {}
    before = dict(memo)
    ident["files"] = {f.name: _content_sha256(f, memo) for f in files}
    if memo != before:  # concurrent runs: the last writer wins, the loser's entries are recomputed next time
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(memo_path, memo)
    return ident


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    return {k: v for key, value in d.items() for k, v in _flat(value, f"{prefix}{key}.").items()}


def _nearest_notice(root: Path, key: dict[str, Any], new: Path) -> None:
    """On a new cache folder: name the existing cache closest to `key` and what differs (at most 4 entries: a
    teacher or a setting edited since), so a rebuild is never a surprise."""
    want, best = _flat(key), None
    for other in root.glob("*/key.json"):
        if other.parent == new:
            continue
        try:
            have = _flat(json.loads(other.read_text()))
        except (OSError, ValueError):
            continue
        diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        if best is None or len(diff) < len(best[1]):
            best = (other.parent, diff)
    if best is not None and len(best[1]) <= 4:
        print(f"notice: teacher cache: building {new}; the cache {best[0]} was made with other "
              f"{', '.join(best[1])} (a changed teacher or setting), so it is not reused", file=sys.stderr, flush=True)


def _digest(tensors: dict[str, Tensor]) -> str:
    """sha256 over the shard's tensors (name, dtype, shape and bytes of ids, values, indices)."""
    h = hashlib.sha256()
    for name in ("ids", "values", "indices"):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _verify(path: Path, handle, listed: str) -> None:
    """A shard's tensors against the checksum in its metadata and the one the manifest lists; a mismatch or none is
    an error naming the file."""
    want = (handle.metadata() or {}).get("sha256")
    got = _digest({name: handle.get_tensor(name) for name in ("ids", "values", "indices")})
    if want != got or listed != got:
        why = "has no checksum (written by an older version)" if want is None else "fails its checksum (its data " \
              "changed on disk)"
        raise ValueError(f"teacher cache shard {path} {why}; delete it and rerun (its sequences are recomputed "
                         "from the teacher)")


class TeacherCache:
    """key: what the cached values depend on; a teacher given by spec (key["teacher"]["spec"], as
    pretrained.teacher_identity names it) is keyed by its content instead (`teacher_identity`)."""

    def __init__(self, root: str, key: dict[str, Any], *, shard_sequences: int = 256, rank: int = 0):
        root_dir = Path(root).expanduser()
        if isinstance(key.get("teacher"), dict) and "spec" in key["teacher"]:
            key = {**key, "teacher": teacher_identity(key["teacher"]["spec"], root_dir)}
        blob = json.dumps(key, sort_keys=True)
        self.dir = root_dir / hashlib.sha256(blob.encode()).hexdigest()[:32]
        if not self.dir.is_dir() and root_dir.is_dir():
            _nearest_notice(root_dir, key, self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if not (self.dir / "key.json").exists():
            atomic_write_bytes(self.dir / "key.json", json.dumps(key, indent=2, sort_keys=True).encode())
        self.shard_sequences, self.rank = shard_sequences, rank
        self._index: dict[int, tuple[Path, int]] = {}
        self._handles: dict[Path, Any] = {}
        self._pending: dict[int, tuple[Tensor, Tensor]] = {}
        self._unverified: dict[Path, str] = {}  # shards whose checksum is checked on their first read: their sha256
        self._named = False  # unlisted files are named once
        self._scan()

    def _listed(self) -> dict[str, str]:
        """{shard file: sha256} of every shard the manifest lists (a last line cut by a kill is skipped)."""
        path, fix = self.dir / SHARDS, f"delete the folder {self.dir} (its sequences are recomputed)"
        if not path.is_file():
            return {}
        listed = {}
        for n, rec in log_records(path):
            entry = require_keys(rec, f"{path}: line {n}", {"file": str, "sha256": str}, fix)
            if Path(entry["file"]).name != entry["file"]:
                raise ValueError(f"{path}: line {n} names {entry['file']!r}, not a file of the folder; {fix}")
            listed[entry["file"]] = entry["sha256"]
        return listed

    def _scan(self) -> None:
        listed = self._listed()
        if not self._named:
            self._named = True
            notice_unlisted(self.dir, unlisted(self.dir, listed, own=FIXED), SHARDS)
        for name, sha in sorted(listed.items()):
            path = self.dir / name
            if path in self._handles or not path.is_file():  # a shard deleted (as a damaged one should be): recomputed
                continue
            try:
                handle = safe_open(str(path), framework="pt")
                ids = handle.get_tensor("ids").tolist()
            except Exception as err:  # a damaged shard: never use it silently
                raise ValueError(f"teacher cache shard {path} is unreadable ({err}); delete it and rerun "
                                 "(its sequences are recomputed)") from None
            self._handles[path] = handle
            self._unverified[path] = sha
            for row, i in enumerate(ids):
                self._index.setdefault(int(i), (path, row))

    def __len__(self) -> int:
        return len(set(self._index) | set(self._pending))

    def get(self, ids: list[int]) -> list[tuple[Tensor, Tensor] | None]:
        """For each id: (values (T, k), indices (T, k) int32), or None when not cached."""
        if any(i not in self._index and i not in self._pending for i in ids):
            self._scan()  # another rank or run may have written it since
        out: list[tuple[Tensor, Tensor] | None] = []
        for i in ids:
            if i in self._pending:
                out.append(self._pending[i])
            elif i in self._index:
                path, row = self._index[i]
                h = self._handles[path]
                if path in self._unverified:
                    _verify(path, h, self._unverified.pop(path))
                out.append((h.get_slice("values")[row:row + 1][0], h.get_slice("indices")[row:row + 1][0]))
            else:
                out.append(None)
        return out

    def put(self, ids: list[int], values: Tensor, indices: Tensor) -> None:
        """values, indices: (n, T, k) for the n ids; written out once shard_sequences are pending."""
        for j, i in enumerate(ids):
            self._pending[int(i)] = (values[j].contiguous(), indices[j].to(torch.int32).contiguous())
        if len(self._pending) >= self.shard_sequences:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        ids = sorted(self._pending)
        tensors = {
            "ids": torch.tensor(ids, dtype=torch.int64),
            "values": torch.stack([self._pending[i][0] for i in ids]),
            "indices": torch.stack([self._pending[i][1] for i in ids]),
        }
        name = f"shard-r{self.rank}-{ids[0]:010d}-{uuid.uuid4().hex[:8]}.safetensors"
        digest = _digest(tensors)
        with atomic_path(self.dir / name) as tmp:
            save_file(tensors, str(tmp), metadata={"sha256": digest})
            os.chmod(tmp, 0o644)  # a shared cache: readable by other users' runs
        self._append({"file": name, "sha256": digest, "sequences": len(ids)})  # listed once it is on disk
        self._pending.clear()
        self._scan()

    def _append(self, record: dict[str, Any]) -> None:
        """One line onto the manifest under an exclusive lock (ranks and runs append concurrently), fsynced."""
        import fcntl

        with open(self.dir / SHARDS, "a", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def teacher_meta(self) -> dict[str, Any] | None:
        """teacher.json ({"vocab_sha256", "vocab_size", "logits_dim"}), None before the first run wrote it."""
        path = self.dir / "teacher.json"
        if not path.is_file():
            return None
        fix = f"delete {path} (it is written again from the teacher's tokenizer and config)"
        return require_keys(read_json(path, fix), str(path), {"vocab_sha256": str, "vocab_size": int,
                                                              "logits_dim": int}, fix)

    def set_teacher_meta(self, meta: dict[str, Any]) -> None:
        atomic_write_bytes(self.dir / "teacher.json", json.dumps(meta, indent=2, sort_keys=True).encode())
