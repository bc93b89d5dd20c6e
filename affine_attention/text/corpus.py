"""The embedded default corpus (public-domain Shakespeare, split into train/validation by whole work)
and its packaged byte-level BPE tokenizer, so training and evaluation run offline out of the box.

Both are built by ``scripts/build_corpus.py``; ``affine_attention/data/README.md`` says how.
"""

from __future__ import annotations

import atexit
import functools
import json
import lzma
import shutil
import tempfile
from importlib import resources
from pathlib import Path

SPLITS = ("train", "validation")
EOS_TOKEN = "<|endoftext|>"  # also the bos token and the separator between packed documents
PAD_TOKEN = "<|pad|>"


def _data_dir():
    return resources.files("affine_attention") / "data"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        valid = ", ".join(repr(s) for s in SPLITS)
        raise ValueError(f"unknown corpus split {split!r}; the embedded corpus has splits {valid}")


@functools.lru_cache(maxsize=None)
def _read_works(split: str) -> tuple[tuple[str, str], ...]:
    raw = (_data_dir() / f"corpus-{split}.jsonl.xz").read_bytes()
    # split("\n"), not splitlines(): JSON escapes newlines, but splitlines() would also cut at
    # characters such as U+2028 that JSON leaves unescaped.
    lines = lzma.decompress(raw).decode("utf-8").split("\n")
    works = (json.loads(line) for line in lines if line)
    return tuple((work["title"], work["text"]) for work in works)


def load_corpus(split: str) -> list[dict]:
    """Works of one split as ``[{"title": str, "text": str}, ...]``, in a stable order.

    The decompressed corpus is cached; each call returns fresh dicts, so callers may mutate them.
    """
    _check_split(split)
    return [{"title": title, "text": text} for title, text in _read_works(split)]


def corpus_texts(split: str) -> list[str]:
    """The text of every work in ``split``, in the same order as :func:`load_corpus`."""
    _check_split(split)
    return [text for _, text in _read_works(split)]


@functools.lru_cache(maxsize=None)
def default_tokenizer_path() -> Path:
    """Local folder holding the packaged tokenizer (tokenizer.json and its transformers configs)."""
    folder = _data_dir() / "tokenizer"
    if isinstance(folder, Path):
        return folder
    # Installed inside a zip there is no real folder, and transformers can only load from one.
    target = Path(tempfile.mkdtemp(prefix="affine_attention_tokenizer_"))
    atexit.register(shutil.rmtree, target, ignore_errors=True)
    for entry in folder.iterdir():
        (target / entry.name).write_bytes(entry.read_bytes())
    return target


def default_tokenizer():
    """The packaged tokenizer as a transformers fast tokenizer, loaded offline.

    A new object on every call: tokenizers carry mutable settings (padding side, truncation), and a
    shared instance would let one caller's change leak into another's.
    """
    # Imported here so the corpus itself stays usable without transformers installed.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_tokenizer_path()), local_files_only=True)
