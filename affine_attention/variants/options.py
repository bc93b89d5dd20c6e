"""Typed variant options: dataclasses built from plain dicts, refusing unknown keys and wrong types loudly."""
from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Any, Literal


def _check_type(owner: str, name: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{owner}: option {name!r} must be one of {list(args)}, got {value!r}")
        return value
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(owner, name, value, inner[0])
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{owner}: option {name!r} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{owner}: option {name!r} must be a finite number, got {value!r}")
        return float(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{owner}: option {name!r} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{owner}: option {name!r} must be an integer, got {value!r}")
        return value
    return value


def options_from_dict(cls: type, values: Mapping[str, Any] | None, owner: str):
    """Build options dataclass `cls` from `values`; unknown keys and ill-typed values raise ValueError."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        valid = ", ".join(sorted(fields)) or "none"
        raise ValueError(f"{owner}: unknown option(s) {unknown}; valid options: {valid}")
    hints = typing.get_type_hints(cls)
    checked = {k: _check_type(owner, k, v, hints[k]) for k, v in values.items()}
    return cls(**checked)


def options_to_dict(options) -> dict[str, Any]:
    """JSON-ready dict of an options dataclass (recorded in model configs and checkpoints)."""
    return dataclasses.asdict(options)
