"""A per-thread forced choice (a kernel backend, an epilogue implementation) set by a context manager."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable


class ForcedChoice:
    """The name forced in this thread (None: the automatic choice); `check(name)` raises for an unknown one."""

    def __init__(self, check: Callable[[str], object]):
        self._local, self._check = threading.local(), check

    @property
    def current(self) -> str | None:
        return getattr(self._local, "name", None)

    @contextlib.contextmanager
    def use(self, name: str | None):
        if name is not None:
            self._check(name)
        previous = self.current
        self._local.name = name
        try:
            yield
        finally:
            self._local.name = previous
