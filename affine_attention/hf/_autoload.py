"""When the one registration with transformers (hf.registration.register) runs: as soon as transformers is imported,
so that `import affine_attention` stays cheap yet `AutoModelForCausalLM.from_pretrained` finds converted checkpoints.

Why an import hook, the least bad option found (transformers 5.24):
- transformers has no plugin entry point for model types; `AutoConfig.register` / `AutoModelForCausalLM.register`
  need the config and model classes, i.e. transformers imported. Registering eagerly would make
  `import affine_attention` import transformers and its model classes, for users of the ops alone too.
- `_LazyConfigMapping` resolves lazily only model types under `transformers.models.*`.
- The checkpoint's `auto_map` loader (saved with every converted checkpoint) works, but only with
  trust_remote_code=True.
The hook touches nothing of transformers itself: it wraps the module loaders of transformers and of this package's
own modules. Only the top-level package imports this module, and no module of the package knows the hook: when one
of them imports transformers first (hf.attention, hf.packing, ...), registering there would meet it half-initialised,
so the hook counts the package's modules being executed and registers once the outermost has finished. It removes
itself before registering (so it runs once), and a failed registration warns instead of breaking an import.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_PACKAGE = __name__.split(".")[0]


def register() -> None:
    """Import hf.registration and register (idempotent); a failure warns: it must not break `import transformers`."""
    try:
        importlib.import_module("affine_attention.hf.registration").register()
    except Exception as err:
        warnings.warn(f"affine_attention could not register its transformers integration ({type(err).__name__}: "
                      f"{err}); converted checkpoints will not load", RuntimeWarning, stacklevel=2)


def _spec_from_other_finders(finder, name, path, target):
    for other in list(sys.meta_path):  # importlib's own search, without this finder (no recursion)
        if other is not finder and hasattr(other, "find_spec"):
            spec = other.find_spec(name, path, target)
            if spec is not None:
                return spec
    return None


class _RegisterAfterTransformers(importlib.abc.MetaPathFinder):
    """Lets the normal finders locate each module; wraps the execution of transformers (then registration is due) and
    of this package's modules (registration waits until none of them is half-executed)."""

    def __init__(self):
        self.executing = 0  # modules of this package whose code runs right now (nested imports)
        self.due = False  # transformers has been imported: register when `executing` falls to 0

    def find_spec(self, name, path=None, target=None):
        ours = name.startswith(_PACKAGE + ".")
        if name != "transformers" and not ours:
            return None
        spec = _spec_from_other_finders(self, name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            self.executing += ours
            try:
                exec_module(module)
            finally:
                self.executing -= ours
            self.due = self.due or not ours
            if self.due and self.executing == 0:
                uninstall()
                register()

        spec.loader.exec_module = exec_then_register
        return spec


_FINDER = _RegisterAfterTransformers()


def installed() -> bool:
    """Whether the hook still waits (transformers not imported yet, or a module of this package still executing)."""
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
