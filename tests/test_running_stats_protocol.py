"""Running statistics are an explicit protocol (variants.running_stats.RunningStats), found by class and stepped once
per accumulator: alpha_ma has the exact value after N steps however the model is wrapped or copied (PEFT, DDP,
copy.deepcopy, from_pretrained), and a copy that is trained but never stepped is warned about like the original."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_hf_common import tiny

from affine_attention import step_running_stats
from affine_attention.variants import AffineAttention, running_stats

STEPS = 3
IDS = torch.arange(2 * 10).reshape(2, 10) % 100  # (B, T) token ids


def _expected(steps: int) -> float:
    """alpha_ma from 0 after `steps` EMA steps (momentum 0.9) of alpha = 0.5 on every token (W_alpha at zero)."""
    return 0.5 * (1 - 0.9 ** steps)


def _stepped(model, steps: int = STEPS):
    model.train()
    with torch.no_grad():
        for _ in range(steps):
            model(input_ids=IDS)
            step_running_stats(model)
    return model


def _alpha_ma_of_the_layers_that_ran(model) -> list[torch.Tensor]:
    """alpha_ma of every affine layer whose forward ran (under PEFT: the adapter's copies, not the originals)."""
    return [m.alpha_ma for n, m in model.named_modules()
            if isinstance(m, AffineAttention) and ".original_module" not in n]


def _assert_exact(model, steps: int = STEPS):
    got = _alpha_ma_of_the_layers_that_ran(model)
    assert len(got) == 2, "the tiny model has two attention layers"
    for a in got:
        torch.testing.assert_close(a, torch.full_like(a, _expected(steps)), rtol=0, atol=1e-7)


def test_plain_model():
    _assert_exact(_stepped(tiny("llama", "affine")))


def test_under_peft_each_step_is_one_ema_step_of_the_adapters_copy():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from affine_attention.hf.peft import peft_config

    base = tiny("llama", "affine")
    model = get_peft_model(base, peft_config(base, LoraConfig(r=2)))
    _assert_exact(_stepped(model))
    originals = [m.alpha_ma for n, m in model.named_modules()
                 if isinstance(m, AffineAttention) and ".original_module" in n]
    assert len(originals) == 2 and all(not a.any() for a in originals), "the base model's copy never ran"


def test_a_deepcopy_steps_its_own_statistics():
    model = tiny("llama", "affine")
    clone = copy.deepcopy(model)
    _assert_exact(_stepped(clone))
    assert all(not a.any() for a in _alpha_ma_of_the_layers_that_ran(model)), "the original was not touched"


def test_under_ddp(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = tiny("llama", "affine")
        _stepped(torch.nn.parallel.DistributedDataParallel(model))
        _assert_exact(model)
    finally:
        dist.destroy_process_group()


def test_after_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    _stepped(tiny("llama", "affine"), steps=2).save_pretrained(tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    _assert_exact(loaded, steps=2)  # the buffer came back as saved
    _stepped(loaded, steps=1)
    _assert_exact(loaded, steps=3)


def _train_without_stepping(model) -> list[warnings.WarningMessage]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3)
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(input_ids=IDS, labels=IDS).loss.backward()
            opt.step()
            opt.zero_grad()
    return [w for w in caught if issubclass(w.category, running_stats.RunningStatsWarning)]


def test_a_deepcopy_trained_without_stepping_is_warned_about(monkeypatch):
    monkeypatch.setattr(running_stats, "_WARNED", False)
    model = tiny("llama", "affine")
    running_stats._WATCHED.clear()  # only the copy is watched: the warning must come from it
    assert len(_train_without_stepping(copy.deepcopy(model))) == 1


def test_a_peft_model_trained_without_stepping_is_warned_about(monkeypatch):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from affine_attention.hf.peft import peft_config

    monkeypatch.setattr(running_stats, "_WARNED", False)
    base = tiny("llama", "affine")
    running_stats._WATCHED.clear()  # the base model's layers never run under the adapter
    model = get_peft_model(base, peft_config(base, LoraConfig(r=2)))
    assert len(_train_without_stepping(model)) == 1


def test_a_module_reached_twice_is_stepped_once():
    model = tiny("llama", "affine")
    holder = torch.nn.ModuleList([model, model.model.layers[0]])  # layer 0 reachable twice
    mods = running_stats.stat_modules(holder)
    assert len(mods) == 2 and len({id(m.running_accumulator()) for m in mods}) == 2


def test_an_optimizer_step_with_nothing_accumulated_does_not_make_the_next_step_look_missed(monkeypatch):
    """torch.distributed.checkpoint builds optimizer state on resume with a zero-gradient optimizer.step(), before
    any forward: the first real step after it, stepped correctly, must not warn."""
    monkeypatch.setattr(running_stats, "_WARNED", False)
    model = tiny("llama", "affine").train()
    running_stats._WATCHED.clear()
    running_stats.watch(model.model.layers[0].self_attn.attn_variant)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # nothing accumulated yet: the resume's state-building step
        model(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
        step_running_stats(model)
    assert not [w for w in caught if issubclass(w.category, running_stats.RunningStatsWarning)]


def test_the_ddp_ignore_list_comes_from_the_protocol_not_from_names():
    """Any variant's accumulator stays rank-local under transformers' DDP, whatever the buffer is called: a plug-in
    variant counting tokens in `token_tally` gets it ignored, and nothing else of its state is."""
    import affine_attention
    from affine_attention.variants import AttentionVariant, register_variant, unregister_variant
    from affine_attention.variants.base import Display

    class TallyAttention(AttentionVariant, running_stats.RunningStats):
        name = "tally_test"
        display = Display("Tally")

        def __init__(self, shape, options=None):
            super().__init__(shape, options)
            self.register_buffer("token_tally", torch.zeros(shape.num_heads + 1, dtype=torch.int64))
            self.register_buffer("kept", torch.zeros(1))

        def running_accumulator(self):
            return self.token_tally

        def apply_running_stats(self, acc):
            self.token_tally.zero_()

    register_variant(TallyAttention)
    try:
        model = affine_attention.convert(tiny("llama"), "tally_test")
    finally:
        unregister_variant("tally_test")
    want = [f"model.layers.{i}.self_attn.attn_variant.token_tally" for i in range(2)]
    assert model._ddp_params_and_buffers_to_ignore == want
    assert running_stats.accumulator_names(tiny("llama", "affine")) == [
        f"model.layers.{i}.self_attn.attn_variant.alpha_acc" for i in range(2)]
