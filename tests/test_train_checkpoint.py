"""Checkpoints: transformers-loadable, written atomically, damage detected, fallback to the newest intact one."""
from __future__ import annotations

import json

import pytest
import torch

from affine_attention.train import checkpoint as ckpt
from affine_attention.train.config import ModelConfig, OptimConfig
from affine_attention.train.distributed import full_state
from affine_attention.train.model import build_base, convert
from affine_attention.train.optim import build_optimizer


@pytest.fixture(scope="module")
def trained():
    from affine_attention.train.pretrained import load_tokenizer

    tok = load_tokenizer("default")
    model = convert(build_base(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                                           num_kv_heads=1), seed=0, eos_token_id=0, pad_token_id=1), "affine")
    opt = build_optimizer(model, OptimConfig())
    x = torch.randint(0, 4096, (2, 9))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    msd, osd = full_state(model, opt)
    return model, opt, tok, msd, osd


def _save(target, trained, step):
    model, _, tok, msd, osd = trained
    return ckpt.save(target, model=model, model_sd=msd, optim_sd=osd, tokenizer=tok,
                     trainer_state={"step": step, "data": {"position": step}, "wall_time": 1.0, "tokens": 0,
                                    "config": {}})


def test_round_trip_and_transformers_loadable(trained, tmp_path):
    model, opt, _, msd, osd = trained
    path = _save(tmp_path / "checkpoints" / "step-00000003", trained, 3)
    assert ckpt.verify(path) is None
    state = ckpt.load_training_state(path)
    assert state["trainer_state"]["step"] == 3
    for name, value in msd.items():
        if name != "lm_head.weight":  # tied to the embedding: stored once
            assert torch.equal(state["model"][name], value), name
    assert "model.layers.0.self_attn.attn_variant.alpha_ma" in state["model"]
    for name, st in osd["state"].items():
        for key, value in st.items():
            assert torch.equal(state["optimizer"]["state"][name][key], value)
    assert state["optimizer"]["param_groups"][0]["betas"] == tuple(osd["param_groups"][0]["betas"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import affine_attention  # noqa: F401  (registers the converted classes)

    loaded = AutoModelForCausalLM.from_pretrained(path)
    x = torch.randint(0, 4096, (1, 6))
    model.eval(), loaded.eval()
    assert torch.allclose(loaded(input_ids=x).logits, model(input_ids=x).logits, atol=1e-6)
    assert len(AutoTokenizer.from_pretrained(path)) == 4096


def test_a_failed_save_leaves_nothing_behind(trained, tmp_path, monkeypatch):
    good = _save(tmp_path / "final", trained, 2)
    model, _, tok, msd, osd = trained

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(tok, "save_pretrained", boom)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path / "final", trained, 5)
    assert [p.name for p in tmp_path.iterdir()] == ["final"]  # no temporary folder left, the old one intact
    assert ckpt.verify(good) is None and ckpt.candidates(tmp_path)[0][0] == 2


@pytest.mark.parametrize("damage, message", [
    ("truncate", "truncated"), ("flip", "sha256"), ("manifest", "MANIFEST.json is missing"), ("delete", "missing"),
])
def test_damage_is_detected(trained, tmp_path, damage, message):
    path = _save(tmp_path / "c", trained, 1)
    weights = path / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "flip":
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "manifest":
        (path / ckpt.MANIFEST).unlink()
    else:
        (path / "optimizer.safetensors").unlink()
    assert message in ckpt.verify(path)


def test_resume_falls_back_to_the_newest_intact_checkpoint(trained, tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path / "checkpoints" / ckpt.step_name(step), trained, step)
    newest = tmp_path / "checkpoints" / ckpt.step_name(6)
    (newest / "model.safetensors").write_bytes(b"\0" * 10)
    said = []
    assert ckpt.newest_intact(tmp_path, log=said.append) == tmp_path / "checkpoints" / ckpt.step_name(4)
    assert len(said) == 1 and "step-00000006 is damaged" in said[0] and "next newest" in said[0]
    for step in (2, 4):
        (tmp_path / "checkpoints" / ckpt.step_name(step) / ckpt.MANIFEST).unlink()
    with pytest.raises(ValueError, match="no intact checkpoint"):
        ckpt.newest_intact(tmp_path, log=said.append)
    with pytest.raises(ValueError, match="no checkpoint in"):
        ckpt.newest_intact(tmp_path / "elsewhere")


def test_prune_keeps_the_newest(trained, tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path / "checkpoints" / ckpt.step_name(step), trained, step)
    _save(tmp_path / "final", trained, 3)
    ckpt.prune(tmp_path, keep=2)
    assert [s for s, _ in ckpt.candidates(tmp_path)] == [3, 3, 2]
    assert json.loads((tmp_path / "final" / ckpt.MANIFEST).read_text())["step"] == 3
