"""The colour, label, marker and line style of each attention variant, read from the variant registry (each variant
declares its `display`), so every figure and report agrees; names outside the registry get a stable fallback."""
from __future__ import annotations

import zlib
from typing import NamedTuple, Union

from ..variants import OKABE_ITO, REGISTRY

__all__ = ["VariantStyle", "OKABE_ITO", "style_for", "color", "label", "linestyle", "marker"]


class VariantStyle(NamedTuple):
    color: str
    label: str
    linestyle: Union[str, tuple] = "-"
    marker: str = "o"


# Unknown names (e.g. "sigmoid" vs "linear_clip" alpha ablations) draw from these, keyed by a stable hash.
# Yellow comes last because it is the hardest to read on white.
_FALLBACK = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#999999", "#F0E442"]
_FALLBACK_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*", "h"]


def _key(name: str) -> str:
    return str(name).strip().lower().replace("-", "_")


def style_for(name: str) -> VariantStyle:
    """Style of a variant; unknown names get a deterministic fallback colour and marker (same name -> same style in
    every process, unlike hash()) and their own name as label."""
    key = _key(name)
    if key in REGISTRY:
        d = REGISTRY[key].display
        return VariantStyle(d.color, d.label, d.linestyle, d.marker)
    h = zlib.crc32(key.encode())
    return VariantStyle(_FALLBACK[h % len(_FALLBACK)], str(name), "-", _FALLBACK_MARKERS[h % len(_FALLBACK_MARKERS)])


def color(name: str) -> str:
    """Hex colour of a variant."""
    return style_for(name).color


def label(name: str) -> str:
    """Human-readable legend label of a variant."""
    return style_for(name).label


def linestyle(name: str) -> str | tuple:
    """Matplotlib line style of a variant."""
    return style_for(name).linestyle


def marker(name: str) -> str:
    """Matplotlib marker of a variant."""
    return style_for(name).marker
