"""Atomic file writes for results other steps trust by their presence (result.json, summaries, caches): a kill
mid-write leaves the old file or none, never a truncated one."""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to a hidden temporary file beside `path`, flush it to disk, then rename it over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, data: Any, **dumps) -> None:
    """json.dumps(data, **dumps) (indent=2 unless given), written atomically."""
    atomic_write_text(path, json.dumps(data, **{"indent": 2, **dumps}))
