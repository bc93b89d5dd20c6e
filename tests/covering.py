"""Covering designs for the family x variant crosses: a small set of pairs that still covers every fact the full
cross proves, derived from the family table and the variant registry (nothing here names a family or a variant).

The facts a (family, variant) case proves are of two sorts:
- family-side: the family's seam carries each kind of variant path exactly. A variant's kinds come from what it
  declares: `needs_lse` (the sink inside the kernel), `uses_value_mean` (the affine mean of V), an own
  `output_gate` (the epilogue's gate), or none of these ("plain": the kernel output alone).
- variant-side: the variant's own code (its prologue, its retrofit) works on more than one family layout.
So the design holds, for every family, at least one accepted variant of each kind it accepts, and every variant on
at least `per_variant` families (or every family that accepts it). `uncovered` checks that property on any design,
and `covering_table` names, for every pair left out, the pairs that still prove its facts (docs/testing.md).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from affine_attention.hf.families import family_names, refusal
from affine_attention.variants import AttentionVariant, get_variant, variant_names

KIND_ORDER = ("value_mean", "gate", "lse", "plain")  # richest first: one variant may cover two kinds


def variant_kinds(name: str) -> frozenset[str]:
    """The kinds of path a variant takes through the seam and the kernel, from its declared facts."""
    cls = get_variant(name)
    kinds = set()
    if cls.needs_lse:
        kinds.add("lse")
    if cls.uses_value_mean:
        kinds.add("value_mean")
    if cls.output_gate is not AttentionVariant.output_gate:
        kinds.add("gate")
    return frozenset(kinds or {"plain"})


def accepts(family: str, variant: str) -> bool:
    return refusal(family, variant) is None


def _kinds_of(family: str, variants: Sequence[str], ok: Callable[[str, str], bool]) -> set[str]:
    return set().union(*(variant_kinds(v) for v in variants if ok(family, v)))


def covering_pairs(families: Sequence[str] | None = None, variants: Sequence[str] | None = None, *,
                   per_variant: int = 3, ok: Callable[[str, str], bool] = accepts) -> list[tuple[str, str]]:
    """A deterministic covering design (module docstring): greedy, least-used variant first, then the one covering
    most kinds, so the pairs spread over the variants."""
    families = list(family_names(core=True) if families is None else families)
    variants = list(variant_names() if variants is None else variants)
    chosen: list[tuple[str, str]] = []
    uses: Counter = Counter()
    for f in families:
        covered: set[str] = set()
        for kind in [k for k in KIND_ORDER if k in _kinds_of(f, variants, ok)]:
            if kind in covered:
                continue
            candidates = [v for v in variants if ok(f, v) and kind in variant_kinds(v)]
            v = min(candidates, key=lambda v: (uses[v], -len(variant_kinds(v)), variants.index(v)))
            chosen.append((f, v))
            uses[v] += 1
            covered |= variant_kinds(v)
    per_family = Counter(f for f, _ in chosen)
    for v in variants:
        open_families = [f for f in families if ok(f, v) and (f, v) not in chosen]
        while uses[v] < per_variant and open_families:
            f = min(open_families, key=lambda f: (per_family[f], families.index(f)))
            open_families.remove(f)
            chosen.append((f, v))
            uses[v] += 1
            per_family[f] += 1
    return sorted(chosen, key=lambda p: (families.index(p[0]), variants.index(p[1])))


def uncovered(design: Sequence[tuple[str, str]], families: Sequence[str] | None = None,
              variants: Sequence[str] | None = None, *, per_variant: int = 3,
              ok: Callable[[str, str], bool] = accepts) -> list[str]:
    """Every fact of the full cross that `design` leaves unproven (empty: the design covers the cross)."""
    families = list(family_names(core=True) if families is None else families)
    variants = list(variant_names() if variants is None else variants)
    missing = [f"{f} x {v}: refused, not a case" for f, v in design if not ok(f, v)]
    for f in families:
        have = set().union(*(variant_kinds(v) for ff, v in design if ff == f and ok(f, v)))
        missing += [f"{f}: no variant of kind {k!r}" for k in sorted(_kinds_of(f, variants, ok) - have)]
    for v in variants:
        want = min(per_variant, sum(ok(f, v) for f in families))
        got = len({f for f, vv in design if vv == v and ok(f, v)})
        if got < want:
            missing.append(f"{v}: on {got} families, fewer than {want}")
    return missing


def split_cross(design: Sequence[tuple[str, str]], families: Sequence[str] | None = None,
                variants: Sequence[str] | None = None, ok: Callable[[str, str], bool] = accepts):
    """pytest params: the design's pairs unmarked, the rest of the accepted cross marked `exhaustive`."""
    import pytest

    families = list(family_names(core=True) if families is None else families)
    variants = list(variant_names() if variants is None else variants)
    chosen = set(design)
    return [pytest.param(f, v, id=f"{f}-{v}", marks=() if (f, v) in chosen else (pytest.mark.exhaustive,))
            for f in families for v in variants if ok(f, v)]


def covering_table(design: Sequence[tuple[str, str]], families: Sequence[str] | None = None,
                   variants: Sequence[str] | None = None, ok: Callable[[str, str], bool] = accepts) -> str:
    """Markdown: each accepted pair left out of the design, and the design's pairs that prove its facts."""
    families = list(family_names(core=True) if families is None else families)
    variants = list(variant_names() if variants is None else variants)
    chosen = set(design)
    rows = ["| left out | its family's path of that kind | the variant on other families |", "|---|---|---|"]
    for f in families:
        for v in variants:
            if not ok(f, v) or (f, v) in chosen:
                continue
            same_kind = [w for ff, w in design if ff == f and variant_kinds(w) & variant_kinds(v)]
            elsewhere = [ff for ff, w in design if w == v]
            rows.append(f"| {f} x {v} | {', '.join(f'{f} x {w}' for w in same_kind)} | {', '.join(elsewhere)} |")
    return "\n".join(rows)


if __name__ == "__main__":  # the table in docs/testing.md: python tests/covering.py
    print(covering_table(covering_pairs()))
