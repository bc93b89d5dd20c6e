"""Registers the converted model types with transformers as soon as transformers is imported, so that
`import affine_attention` stays cheap yet `AutoModelForCausalLM.from_pretrained` finds converted checkpoints."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings


def _register() -> None:
    try:
        importlib.import_module("affine_attention.hf.models")  # registers on import
    except Exception as err:  # a broken registration must not break `import transformers`, but must be visible
        warnings.warn(f"affine_attention could not register its transformers integration ({type(err).__name__}: "
                      f"{err}); converted checkpoints will not load", RuntimeWarning, stacklevel=2)


class _AfterTransformersImport(importlib.abc.MetaPathFinder):
    """One-shot finder: lets the normal finders locate transformers, then registers once its module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        uninstall()
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


_FINDER = _AfterTransformersImport()


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def install() -> None:
    """Register now if transformers is already imported, else right after it is (no-op without transformers)."""
    if "transformers" in sys.modules:
        _register()
    elif importlib.util.find_spec("transformers") is not None and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
