"""Files a run writes and later reads back: the one atomic writer, for files other steps trust by their presence
(result.json, summaries, caches, weights metadata: a kill mid-write leaves the old file or none, never a truncated
one), the one reader of append-only JSON Lines logs (metrics.jsonl: trainer and analysis alike), and JSON read back
on resume."""
from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A hidden temporary path beside `path` for the caller to write (by name: a writer that takes no file object);
    on leaving the block its file is flushed to disk and renamed over `path`, or removed if the block raised."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[IO[bytes]]:
    """A binary file to write that appears at `path` whole, when the block ends without error (see atomic_path)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        yield f


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, data: Any, **dumps) -> None:
    """json.dumps(data, **dumps) (indent=2 unless given), written atomically."""
    atomic_write_text(path, json.dumps(data, **{"indent": 2, **dumps}))


_DAMAGED = "repair or remove that line (only the last line can be cut by a kill)"


def _record(raw: bytes, path: Path, n: int) -> dict[str, Any] | None:
    """One log line as a JSON object (None for a blank line); anything else raises ValueError naming file and line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: line {n}: not UTF-8 text ({err.reason} at byte {err.start}); "
                         f"{_DAMAGED}") from None
    if not line.strip():
        return None
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: line {n}: malformed JSON ({err.msg}); {_DAMAGED}") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{path}: line {n}: expected a JSON object, got {type(rec).__name__}; {_DAMAGED}")
    return rec


def log_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of every non-blank line of an append-only JSON Lines log (one object per line).

    The one rule for a torn line: an append writes a record and its newline, so a kill mid-write can only leave the
    last line without its newline. That line, when it does not parse, is skipped. Any other line that is not UTF-8,
    not JSON or not an object is damage, not a kill: ValueError naming the file and line."""
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    tail = lines.pop()  # what follows the last newline: empty unless the last write was cut short
    for n, raw in enumerate(lines, 1):
        rec = _record(raw, path, n)
        if rec is not None:
            yield n, rec
    try:
        rec = _record(tail, path, len(lines) + 1)
    except ValueError:
        return  # the last write, cut by a kill
    if rec is not None:
        yield len(lines) + 1, rec


def read_json(path: str | Path, fix: str) -> Any:
    """The JSON value in `path`; a damaged file raises a one-line ValueError naming it and saying what to do (`fix`)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        why = f"{err.msg} at line {err.lineno}"
    except UnicodeDecodeError as err:
        why = f"not UTF-8 text at byte {err.start}"
    raise ValueError(f"{path} is damaged (not valid JSON: {why}); {fix}")
