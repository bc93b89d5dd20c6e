"""The package's shape: dependencies point downwards between folders (no cycle), every registered variant is drawn
distinctly, paper configs take their architecture from the one table, and a new variant written in one file plus one
registry line shows up in compare, the report, the figures and the metrics with no other file changed."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from affine_attention import variants
from test_train_helpers import read_records, tiny  # noqa: F401  (fixture)

PACKAGE = Path(__file__).resolve().parent.parent / "affine_attention"
# Floors, lowest first: a module may import its own floor and any lower one, never a higher one.
FLOORS = {"_compat": 0, "_environment": 0, "_files": 0, "_numbers": 0, "_progress": 0, "text": 0, "ops": 1,
          "variants": 2, "hf": 3, "train": 4, "analysis": 4, "eval": 4, "cli": 5, "__init__": 5, "__main__": 5}


def _folder_imports() -> dict[tuple[str, str], set[str]]:
    """(importing floor, imported floor) -> files, from every `import` of affine_attention inside the package."""
    edges: dict[tuple[str, str], set[str]] = {}
    for f in PACKAGE.rglob("*.py"):
        rel = f.relative_to(PACKAGE)
        src = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        pkg = ["affine_attention", *rel.parts[:-1]]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = (pkg[:len(pkg) - node.level + 1] + (node.module or "").split(".")) if node.level else \
                    (node.module or "").split(".")
                mod = [m for m in mod if m]
                targets = [mod + [a.name] for a in node.names] if len(mod) == 1 else [mod]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".") for a in node.names]
            else:
                continue
            for t in targets:
                if t[0] == "affine_attention":
                    dst = t[1] if len(t) > 1 else "__init__"
                    if dst != src:
                        edges.setdefault((src, dst), set()).add(str(rel))
    return edges


def test_dependencies_point_downwards():
    edges = _folder_imports()
    assert ("analysis", "train") not in edges and ("train", "analysis") not in edges
    unknown = {f for e in edges for f in e if f not in FLOORS}
    assert not unknown, f"folders without a floor: {unknown}; add them to FLOORS"
    upward = {e: sorted(fs) for e, fs in edges.items() if FLOORS[e[1]] >= FLOORS[e[0]]}
    assert not upward, f"imports that do not point downwards: {upward}"


def test_every_variant_has_its_own_colour_and_marker():
    shown = {name: cls.display for name, cls in variants.REGISTRY.items()}
    colours = [d.color.upper() for d in shown.values()]
    assert len(set(colours)) == len(shown) and set(colours) <= set(variants.OKABE_ITO.values())
    assert len({d.marker for d in shown.values()}) == len(shown)
    assert len({d.label for d in shown.values()}) == len(shown)
    # the pair that was hard to tell apart (two oranges) now also differs in line style and marker
    sink, affine = shown["sink"], shown["affine"]
    assert sink.linestyle != affine.linestyle and sink.marker != affine.marker


def test_roles_and_control_pairs_come_from_the_registry():
    assert {n: c.role for n, c in variants.REGISTRY.items() if c.role != "baseline"} == {
        "affine": "method", "affine_gated": "method", "scaled_softmax": "control", "affine_frozen": "control"}
    assert variants.control_pairs(["affine", "affine_frozen", "scaled_softmax", "softmax"]) == [
        ("affine", "affine_frozen"), ("affine", "scaled_softmax")]
    assert all(variants.REGISTRY[c].role == "control" and variants.REGISTRY[c].isolates
               for _, c in variants.control_pairs())
    with pytest.raises(ValueError, match="already registered"):
        variants.register_variant(variants.AffineAttention)

    class Undrawn(variants.AttentionVariant):  # forgot its own `display`: softmax's would be ambiguous
        name = "undrawn"

    with pytest.raises(ValueError, match="shares its colour or marker with 'softmax'"):
        variants.register_variant(Undrawn)
    assert "undrawn" not in variants.REGISTRY


def test_paper_configs_take_the_architecture_table_row():
    from affine_attention.hf.presets import PRESETS
    from affine_attention.train.config import config_from_dict, load_config

    mc = load_config("paper-1b").model
    row = PRESETS["llama-3.2-1b"]
    assert mc.preset == "llama-3.2-1b" and mc.num_layers == row["num_hidden_layers"] and mc.head_dim == 64
    assert mc.rope_scaling == row["rope_scaling"] and mc.rope_scaling is not row["rope_scaling"]
    small = config_from_dict({"model": {"preset": "tiny-mistral", "num_layers": 1}}).model
    assert (small.arch, small.num_layers, small.extra) == ("mistral", 1, {"sliding_window": 4})  # keys set win
    with pytest.raises(ValueError, match="not in the architecture table"):
        load_config("tiny", ["model.preset='llama-70b'"])


@pytest.fixture
def example_variant():
    from example_variant import HeadGainAttention

    variants.register_variant(HeadGainAttention)  # the one registry line
    yield HeadGainAttention
    variants.unregister_variant(HeadGainAttention.name)


def _has_colour(png: Path, hex_colour: str, tol: float = 0.03) -> bool:
    import numpy as np
    from matplotlib.image import imread

    rgb = imread(png)[..., :3]
    want = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return bool((np.abs(rgb - want).max(-1) < tol).sum() > 20)


def test_a_new_variant_reaches_compare_report_figures_and_metrics(example_variant, tiny, tmp_path):
    pytest.importorskip("matplotlib")
    from affine_attention.analysis.report import write_report
    from affine_attention.train.compare import compare
    from affine_attention.train.config import load_config

    name = example_variant.name
    cfg = load_config("tiny", tiny + ["train.steps=3", "train.eval_every=3",
                                      f"compare.variants=['softmax', '{name}', 'scaled_softmax']"])
    root = tmp_path / "cmp"
    summary = compare(cfg, root, seeds=1, log=lambda m: None)

    # compare: trained, summarised, its parameter overhead counted (one gain per head and layer)
    assert summary["variants"][name]["param_overhead"] == 2 * 2
    assert f"| {name} | 4 |" in (root / "summary.md").read_text()
    # metrics: the statistics the variant declares, per layer every step and per head at every evaluation
    steps = read_records(root / name / "seed0" / "metrics.jsonl")
    assert all(len(r["gain_mean"]) == 2 and len(r["gain_std"]) == 2 and len(r["head_gain"]) == 2 for r in steps)
    # a step's forwards see the gains left by the previous step (ones at the start)
    assert steps[0]["gain_mean"] == [1.0, 1.0] and steps[0]["gain_std"] == [0.0, 0.0]
    assert steps[2]["gain_mean"] == pytest.approx(steps[1]["head_gain"], abs=1e-6)
    evals = read_records(root / name / "seed0" / "metrics.jsonl", "eval")
    assert [len(e["head_gain"]) for e in evals] == [2, 2] and len(evals[-1]["head_gain"][0]) == 2
    assert "head_gain" not in read_records(root / "softmax" / "seed0" / "metrics.jsonl")[0]
    # report: its role, its control pairing and a figure of its per-token statistic
    paths = write_report(root, sequences=1)
    md = paths["md"].read_text()
    assert f"| {name} | method | 4 |" in md and f"| {name} − scaled_softmax | 1 |" in md
    assert "Controls in this run: scaled_softmax" in md and "![" in md and "figures/gain_training.png" in md
    # figures: drawn in its own colour, in the training curves and the attention diagnostics
    figs = paths["figures"]
    assert _has_colour(figs / "loss.png", example_variant.display.color)
    assert _has_colour(figs / "first_token_mass.png", example_variant.display.color)
    assert json.loads((root / name / "seed0" / "result.json").read_text())["variant"] == name
