"""Files a run writes and later reads back: the one atomic writer (a kill mid-write leaves the old file or none), the
one reader of append-only JSON Lines logs, JSON read back on resume, and the one rule for folders read through their
manifest (only what it lists is ever read) and for an --out that must be writable."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
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


# --- folders read through their manifest ------------------------------------------------------------------------
# Every folder the package writes and reads back (step checkpoints, prepared shards, teacher caches, compare folders,
# exports) lists what it holds in a manifest; readers read only what it lists, and name anything else they find.

def unlisted(folder: str | Path, listed, own=()) -> list[str]:
    """Relative paths of the files under `folder` that neither `listed` nor `own` (the manifest itself and the
    folder's fixed files) names; hidden temporaries of an atomic write in progress (`.NAME.*.tmp`) are not counted."""
    folder, known = Path(folder), set(listed) | set(own)
    return sorted(rel for p in folder.rglob("*") if p.is_file()
                  and (rel := p.relative_to(folder).as_posix()) not in known
                  and not (p.name.startswith(".") and p.name.endswith(".tmp")))


def notice_unlisted(folder: str | Path, extra: list[str], manifest: str) -> None:
    """One line on stderr naming the files of `folder` its manifest does not list (they are never read)."""
    if extra:
        print(f"notice: {folder}: ignoring {len(extra)} file(s) its {manifest} does not list (never read): "
              f"{extra[:5]}{' ...' if len(extra) > 5 else ''}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def listed_view(folder: str | Path, names) -> Iterator[Path]:
    """A temporary folder holding symbolic links to exactly the files `names` (relative paths) of `folder`: for a
    reader that reads a whole folder (torch's DCP safetensors reader, transformers' from_pretrained), so it can
    only see what the manifest lists. Removed on leaving the block (the files themselves are untouched)."""
    folder = Path(folder).absolute()
    view = Path(tempfile.mkdtemp(prefix="affine-attention-view-"))
    try:
        for rel in names:
            link = view / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(folder / rel)
        yield view
    finally:
        shutil.rmtree(view, ignore_errors=True)


def require_keys(record: Any, where: str, keys: dict[str, type | tuple[type, ...]], fix: str) -> dict[str, Any]:
    """`record` when it is a JSON object holding every key of `keys` with a value of its type; else a one-line
    ValueError naming `where`, the key and `fix` (a manifest edited or written by something else)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where} is not a JSON object (got {type(record).__name__}); {fix}")
    for key, kind in keys.items():
        if key not in record:
            raise ValueError(f"{where} has no {key!r} entry; {fix}")
        value = record[key]
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise ValueError(f"{where}: {key!r} is {value!r}, not a {getattr(kind, '__name__', kind)}; {fix}")
    return record


def check_writable(path: str | Path, option: str = "--out") -> None:
    """Refuse `path` (a folder to create or write into) when the nearest existing folder at or above it cannot be
    written: one ValueError naming both, before any work (a read-only mount would otherwise fail mid-way)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path} is an existing file, not a folder; choose another {option}")
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: {existing} is not writable (a read-only filesystem or no permission); "
                         f"choose a writable {option}")


COMPARISON = "comparison.json"  # a compare folder's manifest: train/compare.py writes it, analysis reads through it


def read_comparison(folder: str | Path) -> dict[str, Any] | None:
    """The manifest of compare folder `folder` ({"variants", "seeds", "runs": ["<variant>/seed<k>", ...]}), None
    when it has none (a folder of an older version)."""
    path = Path(folder) / COMPARISON
    if not path.is_file():
        return None
    fix = "it was edited or damaged; restore it or compare into a new --out"
    return require_keys(read_json(path, fix), str(path), {"variants": list, "seeds": int, "runs": list}, fix)
