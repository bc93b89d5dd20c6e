"""Attention variants as modules, behind one registry that validates names and typed options."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

from .affine import AffineAttention, AffineGatedAttention, AffineOptions, linear_clip
from .affine_frozen import AffineFrozenAttention
from .base import OKABE_ITO, AttentionShape, AttentionVariant, Display, palette_colour, palette_marker
from .gated import GatedAttention, GatedOptions
from .options import options_from_dict, options_to_dict
from .scaled_softmax import ScaledSoftmaxAttention
from .sink import OffByOneAttention, SinkAttention, SinkOptions
from .softmax import SoftmaxAttention
from .ssmax import ScalableSoftmaxAttention

REGISTRY: dict[str, type[AttentionVariant]] = {}  # filled by register_variant, the built-ins below first
#: The variant every other is measured against (parameter overheads, paired differences, speed ratios): the base
#: class itself, which plain transformers attention also equals.
REFERENCE = AttentionVariant.name


def register_variant(cls: type[AttentionVariant]) -> type[AttentionVariant]:
    """Add a variant class to the registry (usable as a class decorator); its name must be new."""
    if not (isinstance(cls, type) and issubclass(cls, AttentionVariant)):
        raise ValueError(f"register_variant expects an AttentionVariant subclass, got {cls!r}")
    if cls.name in REGISTRY:
        raise ValueError(f"a variant named {cls.name!r} is already registered ({REGISTRY[cls.name].__name__})")
    if cls.role not in ("method", "baseline", "control"):
        raise ValueError(f"{cls.__name__}.role must be 'method', 'baseline' or 'control', got {cls.role!r}")
    if not isinstance(cls.retrofit_refusal, str):
        raise ValueError(f"{cls.__name__}.retrofit_refusal must be text ('' when the variant can be retrofitted), got "
                         f"{cls.retrofit_refusal!r}")
    used_colours = {other.display.color.upper() for other in REGISTRY.values()}
    used_markers = [other.display.marker for other in REGISTRY.values()]
    if cls.display.color is None or cls.display.marker is None:  # the first free ones of an unbounded palette
        colour = cls.display.color or next(c for c in map(palette_colour, itertools.count())
                                           if c.upper() not in used_colours)
        marker = cls.display.marker or next(m for m in map(palette_marker, itertools.count())
                                            if m not in used_markers)
        cls.display = dataclasses.replace(cls.display, color=colour, marker=marker)
    for other in REGISTRY.values():  # figures tell variants apart by colour and by marker
        if cls.display.color.upper() == other.display.color.upper() or cls.display.marker == other.display.marker:
            raise ValueError(f"{cls.__name__}.display {cls.display} shares its colour or marker with "
                             f"{other.name!r} ({other.display}); give it its own, or leave color / marker None "
                             "for the first free ones of the palette")
    REGISTRY[cls.name] = cls
    return cls


# The built-in variants, through the same checks as a plug-in's (and the palette for a Display without colour).
for _cls in (SoftmaxAttention, OffByOneAttention, SinkAttention, GatedAttention, AffineAttention, AffineGatedAttention,
             ScaledSoftmaxAttention, AffineFrozenAttention, ScalableSoftmaxAttention):
    register_variant(_cls)
del _cls


def unregister_variant(name: str) -> None:
    """Remove a variant added by `register_variant` (tests and plug-ins)."""
    get_variant(name)
    del REGISTRY[name]


def variant_names() -> list[str]:
    return list(REGISTRY)


def get_variant(name: str) -> type[AttentionVariant]:
    if name not in REGISTRY:
        raise ValueError(f"unknown attention variant {name!r}; choose one of {variant_names()}")
    return REGISTRY[name]


def parse_options(name: str, options: Mapping[str, Any] | None = None):
    """The variant's typed options dataclass from a plain dict (unknown keys or bad values raise ValueError).

    A retired option (`retired_options`, what older versions recorded) is dropped when it holds its old neutral
    value, so their checkpoints still load; any other value of it is an unknown option."""
    cls = get_variant(name)
    options = dict(options or {})
    for key, neutral in cls.retired_options.items():
        if key in options and options[key] == neutral:
            del options[key]
    return options_from_dict(cls.Options, options, owner=name)


def build_variant(name: str, shape: AttentionShape, **options) -> AttentionVariant:
    """One attention-variant module for a layer of `shape`."""
    if not isinstance(shape, AttentionShape):
        raise ValueError(f"build_variant: shape must be an AttentionShape(hidden_size, num_heads, num_kv_heads, "
                         f"head_dim), got {type(shape).__name__} {shape!r}")
    return get_variant(name)(shape, parse_options(name, options))


def can_retrofit(name: str) -> bool:
    """Whether `convert(..., function_preserving=True)` can start the variant at the model's function (with suitable
    options; some options can still refuse it). A declared fact: `retrofit_refusal` says why not."""
    return not get_variant(name).retrofit_refusal


def is_control(name: str) -> bool:
    """Controls exist to separate a method's gain from a plain output scale (see the ablation preset)."""
    return get_variant(name).role == "control"


def role(name: str) -> str:
    """"method", "baseline" or "control"."""
    return get_variant(name).role


def control_pairs(names=None) -> list[tuple[str, str]]:
    """(variant, control) pairs to compare by seed, among `names` (default: all registered), in the order of
    `names`."""
    names = list(REGISTRY) if names is None else list(names)
    return [(v, c) for v in names if v in REGISTRY for c in REGISTRY[v].controls if c in names]


def display(name: str) -> Display:
    """Legend label, colour, marker and line style of a registered variant."""
    return get_variant(name).display


__all__ = [
    "OKABE_ITO", "REFERENCE", "REGISTRY", "Display", "can_retrofit", "control_pairs", "display", "register_variant",
    "role", "unregister_variant", "AffineFrozenAttention", "AttentionShape", "AttentionVariant", "AffineAttention",
    "AffineGatedAttention", "AffineOptions", "GatedAttention", "GatedOptions", "OffByOneAttention",
    "ScaledSoftmaxAttention", "SinkAttention", "SinkOptions", "SoftmaxAttention", "build_variant", "get_variant",
    "is_control", "linear_clip", "options_to_dict", "parse_options", "variant_names",
]
