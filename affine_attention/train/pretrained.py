"""Tokenizer and KD-teacher specs for training (loaded through `affine_attention.hf.load`) and what identifies
them in cache keys."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ..hf.load import resolve
from ..text import TEXT_RULE


def load_tokenizer(spec: str):
    """The tokenizer for `data.tokenizer` ("default": the packaged 4096-token BPE, offline; hub names allowed)."""
    from ..hf.load import load_tokenizer as load
    from .data_backcopy import SPEC_PREFIX, tokenizer_from_spec

    # A synthetic task's vocabulary is its own tokenizer (data_backcopy.py); config_load names it in data.tokenizer.
    tok = tokenizer_from_spec(spec) if spec.startswith(SPEC_PREFIX) else load(spec, hub=True)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {spec!r} has no eos token; packing needs one as the document separator")
    return tok


def tokenizer_fingerprint(tok) -> str:
    """sha256 of the tokenizer's full serialisation (vocabulary, merges, normaliser), its eos id and the rule that
    turns documents into ids (text.TEXT_RULE): what the ids of a document depend on, for every cache keyed by it."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tok).__name__} is not a fast tokenizer; training needs a fast (Rust) tokenizer")
    h = hashlib.sha256(backend.to_str().encode())
    h.update(str(tok.eos_token_id).encode())
    h.update(TEXT_RULE.encode())
    return h.hexdigest()


def teacher_identity(spec: str) -> dict[str, Any]:
    """What names a teacher in cache keys: the spec plus, for local files and folders, their sizes and mtimes."""
    path, kwargs = resolve(spec)
    ident: dict[str, Any] = {"spec": spec, **kwargs}
    p = Path(path)
    files = [p / kwargs["gguf_file"]] if "gguf_file" in kwargs else sorted(p.glob("*.safetensors")) if p.is_dir() else []
    ident["files"] = [[f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in files]
    return ident


def load_causal_lm(spec: str, dtype, device):
    """A frozen teacher: transformers causal LM from `spec`, eval mode, requires_grad off (hub names allowed)."""
    from ..hf.load import load_model

    return load_model(spec, dtype=dtype, device=device, hub=True, frozen=True)
