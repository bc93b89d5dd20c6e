"""One fixed colour, label and line style per attention variant, so every figure and report agrees.

Colours are the Okabe-Ito palette (distinguishable under the common forms of colour blindness)."""
from __future__ import annotations

import zlib
from typing import NamedTuple

__all__ = ["VariantStyle", "OKABE_ITO", "style_for", "color", "label", "linestyle"]

OKABE_ITO = {
    "black": "#000000", "orange": "#E69F00", "sky_blue": "#56B4E9", "bluish_green": "#009E73",
    "yellow": "#F0E442", "blue": "#0072B2", "vermillion": "#D55E00", "reddish_purple": "#CC79A7",
    "grey": "#999999",
}


class VariantStyle(NamedTuple):
    color: str
    label: str
    linestyle: str = "-"


_STYLES = {
    "softmax": VariantStyle(OKABE_ITO["black"], "Softmax"),
    "off_by_one": VariantStyle(OKABE_ITO["sky_blue"], "Off-by-one softmax"),
    "sink": VariantStyle(OKABE_ITO["orange"], "Attention sink"),
    "gated": VariantStyle(OKABE_ITO["bluish_green"], "Gated attention"),
    "affine": VariantStyle(OKABE_ITO["vermillion"], "Affine-scaled"),
    "affine_gated": VariantStyle(OKABE_ITO["reddish_purple"], "Affine-scaled + gated"),
    "scaled_softmax": VariantStyle(OKABE_ITO["blue"], "Scaled softmax"),
    # an ablation of "affine": grey and dashed so it reads as secondary next to the real method
    "affine_frozen": VariantStyle(OKABE_ITO["grey"], "Affine-scaled (frozen α)", "--"),
}

# Unknown names (e.g. "sigmoid" vs "linear_clip" alpha ablations) draw from these, keyed by a stable hash.
# Yellow comes last because it is the hardest to read on white.
_FALLBACK = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#999999", "#F0E442"]


def _key(name: str) -> str:
    return str(name).strip().lower().replace("-", "_")


def style_for(name: str) -> VariantStyle:
    """Style of a variant; unknown names get a deterministic fallback colour (same name -> same colour in every
    process, unlike hash()) and their own name as label."""
    key = _key(name)
    if key in _STYLES:
        return _STYLES[key]
    return VariantStyle(_FALLBACK[zlib.crc32(key.encode()) % len(_FALLBACK)], str(name))


def color(name: str) -> str:
    """Hex colour of a variant."""
    return style_for(name).color


def label(name: str) -> str:
    """Human-readable legend label of a variant."""
    return style_for(name).label


def linestyle(name: str) -> str:
    """Matplotlib line style of a variant."""
    return style_for(name).linestyle
