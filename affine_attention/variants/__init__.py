"""Attention variants as modules, behind one registry that validates names and typed options."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .affine import AffineAttention, AffineGatedAttention, AffineOptions, linear_clip
from .affine_frozen import AffineFrozenAttention
from .base import AttentionShape, AttentionVariant
from .gated import GatedAttention, GatedOptions
from .options import options_from_dict, options_to_dict
from .scaled_softmax import ScaledSoftmaxAttention
from .sink import OffByOneAttention, SinkAttention, SinkOptions
from .softmax import SoftmaxAttention

REGISTRY: dict[str, type[AttentionVariant]] = {
    cls.name: cls for cls in (SoftmaxAttention, OffByOneAttention, SinkAttention, GatedAttention, AffineAttention,
                              AffineGatedAttention, ScaledSoftmaxAttention, AffineFrozenAttention)
}


def variant_names() -> list[str]:
    return list(REGISTRY)


def get_variant(name: str) -> type[AttentionVariant]:
    if name not in REGISTRY:
        raise ValueError(f"unknown attention variant {name!r}; choose one of {variant_names()}")
    return REGISTRY[name]


def parse_options(name: str, options: Mapping[str, Any] | None = None):
    """The variant's typed options dataclass from a plain dict (unknown keys or bad values raise ValueError)."""
    return options_from_dict(get_variant(name).Options, options, owner=name)


def build_variant(name: str, shape: AttentionShape, **options) -> AttentionVariant:
    """One attention-variant module for a layer of `shape`."""
    return get_variant(name)(shape, parse_options(name, options))


def is_control(name: str) -> bool:
    """Controls exist to separate a method's gain from a plain output scale (see the ablation preset)."""
    return bool(getattr(get_variant(name), "control", False))


__all__ = [
    "REGISTRY", "AffineFrozenAttention", "AttentionShape", "AttentionVariant", "AffineAttention", "AffineGatedAttention", "AffineOptions",
    "GatedAttention", "GatedOptions", "OffByOneAttention", "ScaledSoftmaxAttention", "SinkAttention", "SinkOptions",
    "SoftmaxAttention", "build_variant", "get_variant", "is_control", "linear_clip", "options_to_dict",
    "parse_options", "variant_names",
]
