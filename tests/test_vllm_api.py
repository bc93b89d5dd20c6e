"""Every vLLM symbol, parameter and attribute the serving plugin uses exists in the newest CUDA vLLM (a snapshot of its
wheel's sources, tests/vllm_api/, taken by scripts/vllm_api.py) and in the installed vLLM (environment 3), read from
sources without importing them: an upstream rename fails here, not in a user's server."""
from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import vllm_api  # noqa: E402

SNAPSHOTS = sorted((ROOT / "tests" / "vllm_api").glob("vllm-*.json"))


def newest() -> dict:
    return json.loads(max(SNAPSHOTS, key=lambda p: [int(x) for x in p.stem.split("-")[1].split(".")]).read_text())


def test_the_plugins_needs_are_read_from_its_source():
    needs = vllm_api.requirements()
    attention = "vllm.model_executor.layers.attention"
    calls = {n["name"]: n["call"] for n in needs if "call" in n}
    # the rebuilt Attention, with the sink keywords passed through **extra
    assert {"num_kv_heads", "per_layer_sliding_window", "sinks", "attn_backend"} <= set(calls["Attention"]["keywords"])
    assert {"has_sink", "attn_type"} <= set(calls["get_attn_backend"]["keywords"])
    assert {n["attr"] for n in needs if n.get("attr") and n["module"] == attention} >= {
        "num_heads", "num_kv_heads", "head_size", "layer_name", "sliding_window", "impl"}
    assert {n["name"] for n in needs if n.get("family_class")} == {
        "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"}
    assert not [n for n in needs if n["module"] == "vllm" and n["name"] not in ("ModelRegistry",)], (
        "a relative import of the package's own vllm.py was read as vLLM's")


def test_the_newest_vllm_has_what_the_plugin_uses():
    snapshot = newest()
    assert snapshot["version"] >= "0.34", snapshot["version"]
    problems = vllm_api.check(vllm_api.Release(snapshot=snapshot), vllm_api.requirements())
    assert problems == [], "\n".join(problems)


def test_a_renamed_or_changed_symbol_fails_the_check():
    snapshot = copy.deepcopy(newest())
    modules = snapshot["modules"]
    selector = modules["vllm.v1.attention.selector"]
    selector["select_attn_backend"] = selector.pop("get_attn_backend")
    attention = next(m for m in modules.values() if m and "Attention" in m and m["Attention"]["kind"] == "class")
    attention["Attention"]["attrs"].remove("layer_name")
    fa = modules["vllm.v1.attention.backends.fa_utils"]["get_flash_attn_version"]
    fa["params"].remove("has_sinks")
    problems = "\n".join(vllm_api.check(vllm_api.Release(snapshot=snapshot), vllm_api.requirements()))
    assert "vllm.v1.attention.selector.get_attn_backend does not exist in vLLM" in problems, problems
    assert "get_flash_attn_version: no parameter 'has_sinks'" in problems, problems
    assert "instances have no attribute 'layer_name'" in problems, problems


def test_a_new_use_of_vllm_in_the_plugin_is_checked_too(tmp_path):
    (tmp_path / "vllm_extra.py").write_text(
        "from vllm.v1.attention.selector import get_attn_backend\n"
        "from vllm.distributed import get_pp_group\n"
        "def f():\n    return get_attn_backend(64, None, None, has_sinks=True), get_pp_group(1, 2)\n")
    needs = vllm_api.requirements(tmp_path)
    problems = "\n".join(vllm_api.check(vllm_api.Release(snapshot=newest()), needs))
    assert "get_attn_backend: no parameter 'has_sinks'" in problems, problems
    assert "get_pp_group: takes 0 positional arguments, the plugin passes 2" in problems, problems


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is installed in CI's environment 3")
def test_the_installed_vllm_has_what_the_plugin_uses():
    release = vllm_api.Release(root=vllm_api.installed_root())
    problems = vllm_api.check(release, vllm_api.requirements())
    assert release.version != "unknown" and problems == [], "\n".join(problems)
