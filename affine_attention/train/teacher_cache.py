"""On-disk cache of teacher top-k logits: safetensors shards keyed by sequence id, in a folder named by a hash of
(data, seq_len, teacher, k, dtype), so every run that sees the same sequences reuses them.

Layout: <cache_dir>/<hash>/key.json (what the hash covers), teacher.json (the teacher's vocabulary fingerprint and
output size, so later runs check the student without loading the teacher) and shard-*.safetensors, each holding
ids (n,) int64, values (n, T, k) in the teacher's logits dtype and indices (n, T, k) int32. Shards are written to a
temporary name, fsynced and renamed, so a reader never sees a partial shard; several ranks or runs may write
concurrently (unique names; a sequence cached twice holds identical data). Rows are read lazily (memory-mapped);
each shard carries a sha256 of its tensors in its safetensors metadata, checked when its first row is read.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from .._files import atomic_path, atomic_write_bytes


def _digest(tensors: dict[str, Tensor]) -> str:
    """sha256 over the shard's tensors (name, dtype, shape and bytes of ids, values, indices)."""
    h = hashlib.sha256()
    for name in ("ids", "values", "indices"):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _verify(path: Path, handle) -> None:
    """A shard's tensors against the checksum in its metadata; a mismatch or none is an error naming the file."""
    want = (handle.metadata() or {}).get("sha256")
    got = _digest({name: handle.get_tensor(name) for name in ("ids", "values", "indices")})
    if want != got:
        why = "has no checksum (written by an older version)" if want is None else "fails its checksum (its data " \
              "changed on disk)"
        raise ValueError(f"teacher cache shard {path} {why}; delete it and rerun (its sequences are recomputed "
                         "from the teacher)")


class TeacherCache:
    def __init__(self, root: str, key: dict[str, Any], *, shard_sequences: int = 256, rank: int = 0):
        blob = json.dumps(key, sort_keys=True)
        self.dir = Path(root).expanduser() / hashlib.sha256(blob.encode()).hexdigest()[:32]
        self.dir.mkdir(parents=True, exist_ok=True)
        if not (self.dir / "key.json").exists():
            atomic_write_bytes(self.dir / "key.json", json.dumps(key, indent=2, sort_keys=True).encode())
        self.shard_sequences, self.rank = shard_sequences, rank
        self._index: dict[int, tuple[Path, int]] = {}
        self._handles: dict[Path, Any] = {}
        self._pending: dict[int, tuple[Tensor, Tensor]] = {}
        self._unverified: set[Path] = set()  # shards whose checksum is checked on their first read
        self._scan()

    def _scan(self) -> None:
        for path in sorted(self.dir.glob("shard-*.safetensors")):
            if path in self._handles:
                continue
            try:
                handle = safe_open(str(path), framework="pt")
                ids = handle.get_tensor("ids").tolist()
            except Exception as err:  # a damaged shard: never use it silently
                raise ValueError(f"teacher cache shard {path} is unreadable ({err}); delete it and rerun "
                                 "(its sequences are recomputed)") from None
            self._handles[path] = handle
            self._unverified.add(path)
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
                    _verify(path, h)
                    self._unverified.discard(path)
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
        with atomic_path(self.dir / name) as tmp:
            save_file(tensors, str(tmp), metadata={"sha256": _digest(tensors)})
            os.chmod(tmp, 0o644)  # a shared cache: readable by other users' runs
        self._pending.clear()
        self._scan()

    def teacher_meta(self) -> dict[str, Any] | None:
        path = self.dir / "teacher.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def set_teacher_meta(self, meta: dict[str, Any]) -> None:
        atomic_write_bytes(self.dir / "teacher.json", json.dumps(meta, indent=2, sort_keys=True).encode())
