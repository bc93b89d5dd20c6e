"""PEFT round trips on converted models: LoRA + the variants (via `peft_config`) train, save, reload in a fresh
process with identical logits, merge within 1e-6, and never touch the in-memory base model."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from affine_attention import step_running_stats  # noqa: E402
from affine_attention.hf.peft import peft_config  # noqa: E402
from test_hf_common import tiny  # noqa: E402

VARIANTS = ("affine", "sink", "gated", "affine_gated")
IDS = torch.arange(2 * 24).reshape(2, 24) % 128  # (B, T) token ids

RELOAD = r"""
import json, sys, torch
import affine_attention  # registers the converted model types
from peft import PeftModel
from transformers import AutoModelForCausalLM
root, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
out = {}
for variant in json.loads(sys.argv[3]):
    base = AutoModelForCausalLM.from_pretrained(f"{root}/{variant}/base")
    model = PeftModel.from_pretrained(base, f"{root}/{variant}/adapter").eval()
    with torch.no_grad():
        out[variant] = model(input_ids=ids).logits.tolist()
print(json.dumps(out))
"""


def _train(variant: str, root: Path):
    """LoRA (q, v and the MLP's gate_proj) + the variant, 4 AdamW steps with the running statistics stepped."""
    base = tiny("llama", variant)
    base.save_pretrained(root / variant / "base")
    with torch.no_grad():
        before = base(input_ids=IDS).logits
    config = peft_config(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"]))
    model = get_peft_model(base, config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        batch = torch.randint(0, 128, (2, 16), generator=gen)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
        step_running_stats(model)
    model.eval()
    model.save_pretrained(root / variant / "adapter")
    return base, before, model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    runs = {v: _train(v, root) for v in VARIANTS}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", RELOAD, str(root), json.dumps(IDS.tolist()), json.dumps(VARIANTS)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reloaded = json.loads(proc.stdout.strip().splitlines()[-1])
    return runs, {v: torch.tensor(x) for v, x in reloaded.items()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_adapter_reloads_in_a_fresh_process_with_identical_logits(trained, variant):
    (base, before, model), reloaded = trained[0][variant], trained[1][variant]
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    assert torch.equal(logits, reloaded.to(logits.dtype))


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_trains_in_the_adapter_and_the_base_model_is_untouched(trained, variant):
    base, before, model = trained[0][variant]
    with torch.no_grad(), model.disable_adapter():
        assert torch.equal(model(input_ids=IDS).logits, before), "the in-memory base model changed"
    # Every base weight and buffer, under its wrapped name (LoRA's base_layer, modules_to_save's original_module).
    fresh = tiny("llama", variant).state_dict()
    wrapped = {k.replace(".base_layer", "").replace(".original_module", ""): v for k, v in base.state_dict().items()
               if "lora_" not in k and ".modules_to_save." not in k}
    assert fresh.keys() == wrapped.keys() and all(torch.equal(fresh[k], wrapped[k]) for k in fresh)
    state = model.state_dict()
    moved = [k for k, v in state.items() if ".attn_variant.modules_to_save." in k
             and not torch.equal(v, state[k.replace("modules_to_save.default", "original_module")])]
    assert moved, "the variant's parameters did not train"
    if variant in ("affine", "affine_gated"):
        assert any(k.endswith("alpha_ma") for k in moved), "alpha_ma was not stepped in the adapter's copy"
    # gate_proj got LoRA in the MLP only: the variant's gate_proj is trained whole, inside modules_to_save.
    lora = [n for n, _ in model.named_modules() if n.endswith("lora_A")]
    assert lora and not any(".attn_variant." in n for n in lora)
    assert any(".mlp.gate_proj." in n for n in lora)


@pytest.mark.parametrize("variant", VARIANTS)
def test_merge_and_unload_matches_within_1e_6(trained, variant):
    import copy

    _, _, model = trained[0][variant]
    with torch.no_grad():
        want = model(input_ids=IDS).logits
        merged = copy.deepcopy(model).merge_and_unload()
        got = merged(input_ids=IDS).logits
    assert type(merged).__name__ == "AffineLlamaForCausalLM"
    assert (got - want).abs().max().item() < 1e-6


def test_peft_config_arguments():
    model = tiny("llama", "affine")
    config = peft_config(model, r=2)
    assert "attn_variant" in config.modules_to_save
    assert all(t in config.target_modules for t in ("q_proj", "v_proj"))  # the family's (test_hf_families.py)
    with pytest.raises(ValueError, match="not converted"):
        peft_config(tiny("llama"), r=2)
    with pytest.raises(ValueError, match="all-linear"):
        peft_config(model, target_modules="all-linear")
    with pytest.raises(ValueError, match="either a config or keyword"):
        peft_config(model, LoraConfig(r=2), r=4)


def test_a_plain_lora_config_is_warned_about_when_training_starts():
    from affine_attention.hf.callbacks import RunningStatsCallback
    from affine_attention.hf.peft import AdapterWarning, check_adapter

    plain = get_peft_model(tiny("llama", "affine"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with pytest.warns(AdapterWarning, match="peft_config"):
        RunningStatsCallback().on_train_begin(None, None, None, model=plain)
    good = tiny("llama", "affine")
    assert check_adapter(get_peft_model(good, peft_config(good, r=2))) and check_adapter(good)
