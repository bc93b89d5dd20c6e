"""A few recent results keyed by a tensor's identity and version, for per-call work on a mask that every layer of
one model forward shares (validation with a host sync, varlen plans): it runs once per forward, never again on a
tensor written to since."""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

from torch import Tensor

MISS = object()


class TensorMemo:
    """Up to `size` entries; a key is the viewed tensor (weakly: a dead one never matches), its version counter,
    the view's geometry and dtype, and whatever else the result depends on (hashable)."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict = OrderedDict()

    @staticmethod
    def _key(t: Tensor, extra: tuple) -> tuple[tuple | None, Tensor]:
        # Callers hand every layer a new view of one tensor: key on the tensor it views. In-place writes to any
        # view bump the shared version counter.
        base = t if t._base is None else t._base
        try:
            return (id(base), base._version, t.storage_offset(), t.shape, t.stride(), t.dtype, *extra), base
        except RuntimeError:  # inference tensors have no version counter: never cached
            return None, base

    def get(self, t: Tensor, *extra) -> Any:
        """The stored result, or MISS."""
        key, base = self._key(t, extra)
        hit = self._entries.get(key) if key is not None else None
        if hit is None or hit[0]() is not base:
            return MISS
        try:
            self._entries.move_to_end(key)
        except KeyError:  # evicted by another thread meanwhile: the result is still right
            pass
        return hit[1]

    def put(self, t: Tensor, value: Any, *extra) -> Any:
        key, base = self._key(t, extra)
        if key is not None:
            self._entries[key] = (weakref.ref(base), value)
            while len(self._entries) > self.size:
                try:
                    self._entries.popitem(last=False)
                except KeyError:  # emptied by another thread meanwhile
                    break
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
