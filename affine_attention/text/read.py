"""The one text reader: documents (str) from .txt/.md, .jsonl/.json and .parquet files, a `datasets` hub source or
the packaged corpus, in a fixed order; bad input raises ValueError naming the file and line."""
from __future__ import annotations

import glob
import itertools
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .corpus import corpus_texts

FILE_TYPES = ".txt/.md (one document per file), .jsonl/.json (one JSON object per line) or .parquet"
BOM = "\ufeff"


def without_bom(text: Any) -> Any:
    """The one byte-order-mark rule of every reader: a U+FEFF that starts a file or a document is the mark an editor
    writes, not text (it would train as 3 byte tokens), so it is dropped; one anywhere else is text and kept. What is
    not a str passes unchanged, for its reader to refuse by name."""
    return text[1:] if isinstance(text, str) and text.startswith(BOM) else text


def expand(patterns: Sequence[str]) -> list[Path]:
    """The files matching each glob pattern, sorted per pattern; a pattern matching nothing raises ValueError."""
    out: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(str(pattern))))
        if not matches:
            raise ValueError(f"data file pattern {str(pattern)!r} matches no file")
        for m in matches:
            if not os.path.isfile(m):
                raise ValueError(f"data path {m!r} (from {str(pattern)!r}) is not a file; name files or a glob "
                                 f"such as {os.path.join(m, '*.jsonl')!r}")
        out.extend(Path(m) for m in matches)
    return out


def json_lines(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of every non-blank line of a JSON Lines file; malformed JSON raises ValueError
    naming the file and line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}: line {n}: not UTF-8 text ({err.reason} at byte {err.start}); "
                                 "re-encode the file as UTF-8") from None
            if n == 1:
                line = without_bom(line)
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {n}: malformed JSON ({err.msg})") from None


def file_documents(path: str | Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one file: a .txt/.md file is one document; .jsonl/.json one object per line with a string
    field `text_field`; .parquet the column `text_field`. A leading byte order mark is dropped (`without_bom`)."""
    return (without_bom(doc) for doc in _file_documents(path, text_field))


def _file_documents(path: str | Path, text_field: str) -> Iterator[str]:
    path = Path(path)
    suffix = path.suffix.lower()
    if not path.is_file():
        raise ValueError(f"{path} is not a file; pass a {FILE_TYPES} file")
    if suffix in (".txt", ".md"):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            line = path.read_bytes()[:err.start].count(b"\n") + 1
            raise ValueError(f"{path}: line {line}: not UTF-8 text ({err.reason} at byte {err.start}); "
                             "re-encode the file as UTF-8") from None
        yield text
    elif suffix in (".jsonl", ".json"):
        for n, obj in json_lines(path):
            if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                raise ValueError(f"{path}:{n}: expected a JSON object with a string field {text_field!r} "
                                 "(set the text field / column option)")
            yield obj[text_field]
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            raise ValueError(f"{path}: no column {text_field!r}; columns: {pf.schema_arrow.names}")
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            yield from batch.column(0).to_pylist()
    else:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use {FILE_TYPES}")


def _hub_documents(name: str, *, subset: str = "", split: str = "train", revision: str = "",
                   paths: Sequence[str] = (), text_field: str = "text", skip: int = 0, rank: int = 0,
                   world: int = 1) -> Iterator[str]:
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    kwargs: dict[str, Any] = {"split": split, "streaming": True}
    if revision:
        kwargs["revision"] = revision
    if paths:  # a builder ("json", "parquet", "text") over local or remote files
        kwargs["data_files"] = list(paths)
    ds = load_dataset(name, subset or None, **kwargs)
    if world > 1:  # whole files per rank when their number divides by the ranks, else every world-th document
        ds = split_dataset_by_node(ds, rank=rank, world_size=world)
    if skip and world == 1:
        ds = ds.skip(skip)
    elif skip:  # datasets applies .skip before the split by node: it would count every rank's documents
        ds = itertools.islice(ds, skip, None)
    for ex in ds:
        if text_field not in ex:
            raise ValueError(f"dataset {name!r} has no field {text_field!r}; fields: {sorted(ex)}")
        yield without_bom(ex[text_field])


def documents(kind: str, *, split: str = "train", paths: Sequence[str] = (), text_field: str = "text",
              name: str = "", subset: str = "", revision: str = "", skip: int = 0, rank: int = 0,
              world: int = 1) -> Iterator[str]:
    """The documents of a source in their fixed order, after skipping the first `skip`.

    kind: "corpus" (the packaged corpus, `split` = train or validation), "files" (`paths`: files or glob patterns)
    or "hub" (a `datasets` name or builder, streamed; network unless cached). A hub stream with world > 1 yields
    only the documents of `rank` (datasets.distributed.split_dataset_by_node; `skip` counts those)."""
    if world > 1 and kind != "hub":
        raise ValueError(f"only a hub stream is read split by rank, not a {kind!r} source")
    if kind == "corpus":
        yield from corpus_texts(split)[skip:]
    elif kind == "files":
        it = (doc for p in expand(paths) for doc in file_documents(p, text_field))
        for i, doc in enumerate(it):
            if i >= skip:
                yield doc
    elif kind == "hub":
        yield from _hub_documents(name, subset=subset, split=split, revision=revision, paths=paths,
                                  text_field=text_field, skip=skip, rank=rank, world=world)
    else:
        raise ValueError(f"unknown text source kind {kind!r}; use 'corpus', 'files' or 'hub'")


def read_documents(texts: Any, text_field: str = "text") -> list[str]:
    """Documents from a file path (see `file_documents`), a `datasets.Dataset` / `IterableDataset` (column
    `text_field`) or an iterable of str."""
    if isinstance(texts, (str, Path)):
        path = Path(texts)
        if not path.is_file():
            raise ValueError(f"{str(texts)[:80]!r} is not a file; pass a path to a {FILE_TYPES} file, "
                             "or a list of strings to use raw text")
        return list(file_documents(path, text_field))
    datasets = sys.modules.get("datasets")  # a Dataset can only exist if the library is imported
    if datasets is not None:
        if isinstance(texts, datasets.DatasetDict):
            raise ValueError(f"got a DatasetDict with splits {list(texts)}; pass one split, e.g. ds['validation']")
        if isinstance(texts, (datasets.Dataset, datasets.IterableDataset)):
            columns = texts.column_names
            if columns is not None and text_field not in columns:
                raise ValueError(f"the dataset has no column {text_field!r} (columns: {columns}); set text_column")
            texts = (row[text_field] for row in texts)
    if not isinstance(texts, Iterable):
        raise ValueError(f"texts must be a file path, a datasets split or an iterable of str, got "
                         f"{type(texts).__name__}")
    docs = list(texts)
    for index, doc in enumerate(docs):
        if not isinstance(doc, str):
            raise ValueError(f"document {index} is {type(doc).__name__}, expected str")
    return [without_bom(doc) for doc in docs]
