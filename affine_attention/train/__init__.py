"""Training: data (embedded corpus, tokenise, pack), loop, KD loss, optimisers, checkpoints, distributed set-up."""

import importlib

_LAZY = {"train": "loop", "compare": "compare", "load_config": "config_load", "RunConfig": "config"}


def __getattr__(name: str):
    # Lazy, so importing the package (e.g. for the corpus) does not import transformers.
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
