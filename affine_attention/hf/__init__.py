"""Hugging Face transformers integration: `convert`, converted-checkpoint classes, presets and the decode cache.

Importing this package is cheap; submodules that need transformers load on first use.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "convert": "convert", "variant_spec": "layers", "make_spec": "layers",
    "register": "registration", "supported_families": "models",
    "PRESETS": "presets", "preset_config": "presets", "build_model": "presets", "parameter_overhead": "presets",
    "ATTN_IMPLEMENTATION": "attention", "peft_config": "peft",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
