"""The package's shape: dependencies point downwards between folders and no module imports itself back, every
registered variant is drawn distinctly, paper configs take their architecture from the one table, and a new variant
written in one file plus one registry line runs its math and shows up in compare, the report, the figures and the
metrics with no other file changed."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from affine_attention import variants
from test_train_helpers import read_records, tiny  # noqa: F401  (fixture)

PACKAGE = Path(__file__).resolve().parent.parent / "affine_attention"
# Floors, lowest first: a module may import its own floor and any lower one, never a higher one.
FLOORS = {"_compat": 0, "_environment": 0, "_files": 0, "_numbers": 0, "_progress": 0, "_version": 0,
          "text": 1, "ops": 1,
          "variants": 2, "hf": 3, "train": 4, "analysis": 4, "eval": 4, "serving": 4, "cli": 5, "__init__": 5,
          "__main__": 5}


def _module_name(f: Path) -> str:
    parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    p = PACKAGE.parent.joinpath(*dotted.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _is_import_module_call(node: ast.AST) -> bool:
    """`importlib.import_module("...")` or `import_module("...")` with a literal absolute name."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str) and not node.args[0].value.startswith(".")):
        return False
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))


def _module_imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, from every `import` statement in it (in functions too) and every
    `importlib.import_module` of a literal name: `from .x import name` is an edge to module .x, `from . import sub`
    one to the submodule."""
    graph: dict[str, set[str]] = {}
    for f in PACKAGE.rglob("*.py"):
        me = _module_name(f)
        pkg = me.split(".") if f.name == "__init__.py" else me.split(".")[:-1]
        out = graph.setdefault(me, set())
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg[:len(pkg) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{mod}.{a.name}" if _is_module(f"{mod}.{a.name}") else mod for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif _is_import_module_call(node):  # importlib.import_module("affine_attention.x"): an import too
                targets = [node.args[0].value]
            else:
                continue
            out.update(t for t in targets if t.split(".")[0] == "affine_attention" and t != me)
    return graph


def _folder_imports() -> dict[tuple[str, str], set[str]]:
    """(importing floor, imported floor) -> importing modules, from the module graph."""
    def floor(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else "__init__"

    edges: dict[tuple[str, str], set[str]] = {}
    for src, targets in _module_imports().items():
        for dst in targets:
            if floor(dst) != floor(src):
                edges.setdefault((floor(src), floor(dst)), set()).add(src)
    return edges


def test_no_import_cycle_between_modules():
    """Not only between folders: no module reaches itself through the package's imports (a cycle hidden by an
    import inside a function counts too)."""
    graph = _module_imports()
    cycles = []
    for start in graph:  # depth-first search from every module for a path back to it
        stack, seen = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    cycles.append(" -> ".join(path + (start,)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + (nxt,)))
    assert not cycles, f"import cycles: {sorted(set(cycles))[:5]}"


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_one_module_registers_with_transformers_and_the_seam_loads_no_model_family():
    """hf.registration alone registers with transformers (the seam's functions and the converted model types); the
    seam reaches neither it nor the converted classes (hf.models: every family's transformers classes), and only the
    top-level package knows the import hook that runs it."""
    registering = {_module_name(f) for f in PACKAGE.rglob("*.py")
                   if any(isinstance(n, ast.Attribute) and n.attr == "register" and isinstance(n.value, ast.Name)
                          and n.value.id in ("AttentionInterface", "AttentionMaskInterface", "AutoConfig",
                                             "AutoModelForCausalLM") for n in ast.walk(ast.parse(f.read_text())))}
    hf = "affine_attention.hf."
    assert registering == {hf + "registration"}
    graph = _module_imports()
    assert not {hf + "models", hf + "registration", hf + "_autoload"} & _reach(graph, hf + "attention")
    assert {m for m, out in graph.items() if hf + "_autoload" in out} == {"affine_attention"}


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
    palette = {variants.base.palette_colour(i) for i in range(18)}  # Okabe-Ito, then Tol muted: colour-blind safe
    assert len(set(colours)) == len(shown) and set(colours) <= palette
    assert len({d.marker for d in shown.values()}) == len(shown)
    assert len({d.label for d in shown.values()}) == len(shown)
    # the pair that was hard to tell apart (two oranges) now also differs in line style and marker
    sink, affine = shown["sink"], shown["affine"]
    assert sink.linestyle != affine.linestyle and sink.marker != affine.marker


def test_the_registry_takes_any_number_of_variants_each_drawn_distinctly():
    """Past the 9 Okabe-Ito colours and the fixed markers: a variant that names no colour or marker gets the first
    free ones of an unbounded palette, so the 10th (or 40th) variant registers and is told apart."""
    from affine_attention.variants.base import Display

    added, before = [], len(variants.REGISTRY)
    try:
        for i in range(40):
            cls = type(f"Extra{i}", (variants.AttentionVariant,), {"name": f"extra_{i}", "display": Display(f"Extra {i}")})
            added.append(variants.register_variant(cls).name)
        shown = [cls.display for cls in variants.REGISTRY.values()]
        assert len({d.color.upper() for d in shown}) == len(shown) == before + 40
        assert len({d.marker for d in shown}) == len(shown)
        assert all(len(d.color) == 7 and d.color.startswith("#") for d in shown)
        with pytest.raises(ValueError, match="shares its colour or marker"):
            variants.register_variant(type("Clash", (variants.AttentionVariant,), {
                "name": "clash", "display": Display("Clash", shown[0].color, "o")}))
    finally:
        for name in added:
            variants.unregister_variant(name)


def test_built_in_variants_register_through_register_variant(monkeypatch):
    """A built-in declared without a colour or marker gets the palette's like a plug-in (before, the built-ins
    bypassed register_variant: the colour stayed None and the next registration failed on it)."""
    import importlib

    from affine_attention.variants.base import Display

    registry = variants.REGISTRY
    monkeypatch.setattr(variants.ScaledSoftmaxAttention, "display", Display("Scaled softmax"))
    try:
        importlib.reload(variants)
        shown = variants.REGISTRY["scaled_softmax"].display
        assert shown.color is not None and shown.marker is not None
        assert list(variants.REGISTRY) == list(registry)
        extra = variants.register_variant(type("Extra", (variants.AttentionVariant,), {
            "name": "extra", "display": Display("Extra")})).display
        colours = {c.display.color.upper() for c in variants.REGISTRY.values()}
        assert len(colours) == len(variants.REGISTRY) and extra.color.upper() in colours
    finally:
        monkeypatch.undo()
        importlib.reload(variants)
        registry.clear()
        registry.update(variants.REGISTRY)
        variants.REGISTRY = registry  # modules that imported the dict keep the one they hold
    with pytest.raises(ValueError, match="retrofit_refusal must be text"):
        variants.register_variant(type("Odd", (variants.AttentionVariant,), {
            "name": "odd", "display": Display("Odd"), "retrofit_refusal": None}))


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
    from affine_attention.train.config_load import config_from_dict, load_config

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


def test_the_new_variants_math_runs_on_the_fast_path_and_in_the_reference(example_variant):
    """Its output is softmax's times its head gains, and the gains get their exact gradient: the extension point it
    overrides is the one the fast path calls (an override of a method nothing calls leaves softmax)."""
    from affine_attention.variants import AttentionShape, build_variant

    torch.manual_seed(0)
    shape = AttentionShape(hidden_size=8, num_heads=4, num_kv_heads=2, head_dim=4)
    layer, softmax = build_variant(example_variant.name, shape).double(), build_variant("softmax", shape).double()
    with torch.no_grad():
        layer.head_gain.copy_(torch.tensor([0.5, 2.0, -1.0, 3.0]))
    q, k, v = torch.randn(2, 4, 5, 4).double(), torch.randn(2, 2, 5, 4).double(), torch.randn(2, 2, 5, 4).double()
    x = torch.randn(2, 5, 8).double()
    base = softmax(q, k, v, x, is_causal=True)
    out = layer(q, k, v, x, is_causal=True)
    torch.testing.assert_close(out, base * layer.head_gain[None, :, None, None], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.reference(q, k, v, x, is_causal=True)[0], out, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    torch.testing.assert_close(layer.head_gain.grad, base.sum((0, 2, 3)), rtol=1e-12, atol=1e-12)


def test_a_new_variant_reaches_compare_report_figures_and_metrics(example_variant, tiny, tmp_path):
    pytest.importorskip("matplotlib")
    from affine_attention.analysis.report import write_report
    from affine_attention.train.compare import compare
    from affine_attention.train.config_load import load_config

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
    assert all(g != 1.0 for g in steps[2]["head_gain"])  # trained: the gains got gradient
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
