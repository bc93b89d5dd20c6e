"""Affine-Scaled Attention for PyTorch and Hugging Face transformers."""
from __future__ import annotations

from ._version import __version__  # noqa: F401  (pyproject.toml reads it too)


def __getattr__(name: str):
    # Lazy, so `import affine_attention` never imports transformers itself.
    if name == "convert":
        from .hf.convert import convert

        return convert
    if name == "peft_config":
        from .hf.peft import peft_config

        return peft_config
    if name == "step_running_stats":
        from .variants.running_stats import step_running_stats

        return step_running_stats
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _install_transformers_registration() -> None:
    from .hf._autoload import install

    install()


_install_transformers_registration()
