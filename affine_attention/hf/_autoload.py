"""When the one registration with transformers (hf.models.register) runs: as soon as transformers is imported, so that
`import affine_attention` stays cheap yet `AutoModelForCausalLM.from_pretrained` finds converted checkpoints.

Why a one-shot import hook, the least bad option found (transformers 5.24):
- transformers has no plugin entry point for model types; `AutoConfig.register` / `AutoModelForCausalLM.register`
  need the config and model classes, i.e. transformers imported. Registering eagerly would make
  `import affine_attention` import transformers and its model classes, for users of the ops alone too.
- `_LazyConfigMapping` resolves lazily only model types under `transformers.models.*`.
- The checkpoint's `auto_map` loader (saved with every converted checkpoint) works, but only with
  trust_remote_code=True.
The hook touches nothing of transformers itself: it wraps transformers' own module loader for one call, removes
itself before doing anything (so it runs once), and a failed registration warns instead of breaking
`import transformers`. Where transformers is already imported, `install` registers at once and adds no hook. A
module of this package that imports transformers first (hf.attention, or hf.packing on the way from hf.peft) removes
the hook, then calls `register` at its end, once the modules hf.models needs are complete: registering from inside
transformers' import would meet that module half-initialised (the spurious "converted checkpoints will not load"
warning of `from affine_attention import peft_config`).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings


def register() -> None:
    """Import hf.models, which registers the seam and the converted types with transformers (models.register)."""
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
            register()

        spec.loader.exec_module = exec_then_register
        return spec


_FINDER = _AfterTransformersImport()


def installed() -> bool:
    """Whether the hook still waits for transformers (no module of this package has imported it yet)."""
    return _FINDER in sys.meta_path


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def install() -> None:
    """Register now if transformers is already imported, else right after it is (no-op without transformers)."""
    if "transformers" in sys.modules:
        register()
    elif importlib.util.find_spec("transformers") is not None and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
