"""The test suites' bookkeeping: every test file is classified for the CI environments (tests/suites.py), and the
covering designs that replace the full family x variant crosses cover every fact of those crosses."""
from __future__ import annotations

from pathlib import Path

import pytest
from covering import covering_pairs, covering_table, uncovered, variant_kinds
from suites import HELPERS, VERSION_INDEPENDENT, VERSION_SENSITIVE

from affine_attention.hf.families import family_names
from affine_attention.variants import variant_names

TESTS = Path(__file__).resolve().parent


def test_every_test_file_is_in_exactly_one_environment_set():
    files = {p.name for p in TESTS.glob("test_*.py")} - HELPERS
    assert not VERSION_SENSITIVE & VERSION_INDEPENDENT, VERSION_SENSITIVE & VERSION_INDEPENDENT
    assert files == VERSION_SENSITIVE | VERSION_INDEPENDENT, (
        f"unclassified: {sorted(files - VERSION_SENSITIVE - VERSION_INDEPENDENT)}; "
        f"gone: {sorted((VERSION_SENSITIVE | VERSION_INDEPENDENT) - files)} (edit tests/suites.py)")


@pytest.mark.parametrize("variants", [None, "preservable"])
def test_the_covering_design_covers_the_full_cross(variants):
    chosen = None if variants is None else [v for v in variant_names() if v != "off_by_one"]
    design = covering_pairs(variants=chosen)
    assert uncovered(design, variants=chosen) == []
    full = [(f, v) for f in family_names(core=True) for v in (chosen or variant_names())]
    assert len(design) < 0.6 * len(full)  # the point of it


def test_uncovered_names_each_missing_fact():
    design = covering_pairs()
    family = family_names(core=True)[0]
    kinds = {k for f, v in design if f == family for k in variant_kinds(v)}
    kind = sorted(kinds)[0]
    without = [(f, v) for f, v in design if not (f == family and kind in variant_kinds(v))]
    assert any(m.startswith(f"{family}: no variant of kind {kind!r}") for m in uncovered(without))
    variant = design[0][1]
    assert any(m.startswith(f"{variant}: on ") for m in uncovered([p for p in design if p[1] != variant]))


def test_docs_show_the_current_covering_table():
    text = (TESTS.parent / "docs" / "testing.md").read_text()
    assert covering_table(covering_pairs()) in text, "regenerate the table: python tests/covering.py"
