"""Config files: typed overrides, clear errors for unknown keys and bad types, presets by name, package copies in
sync, and `--dry-run` parameter counts of the paper presets."""
from __future__ import annotations


import pytest

from affine_attention.train.config import RunConfig
from affine_attention.train.config_load import config_from_dict, load_config, preset_names, resolve_config_path
from test_train_helpers import REPO


def test_defaults_and_typed_overrides():
    cfg = load_config("tiny", ["train.steps=7", "optim.lr=1e-4", "compare.variants=['softmax', 'affine']",
                               "variant.name=sink", "data.eval.split=validation", "train.compile=true",
                               "optim.lr=2", "variant.options={init = -1.0}"])
    assert isinstance(cfg, RunConfig)
    assert cfg.train.steps == 7 and cfg.optim.lr == 2.0 and isinstance(cfg.optim.lr, float)
    assert cfg.compare.variants == ["softmax", "affine"] and cfg.variant.name == "sink"
    assert cfg.train.compile is True and cfg.variant.options == {"init": -1.0}
    assert cfg.data.eval.kind == "corpus" and cfg.data.train.split == "train"


def test_unknown_keys_are_refused_with_the_valid_ones_listed(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['train.stpes'\] in \[train\]; valid keys: .*steps"):
        load_config("tiny", ["train.stpes=3"])
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['optimizer'\] in the top level; valid keys: "
                                         r"compare, data, kd, model, optim, schedule, train, variant"):
        config_from_dict({"optimizer": {"lr": 1}})
    bad = tmp_path / "bad.toml"
    bad.write_text("[data.train]\nkind = 'corpus'\nfolder = 'x'\n")
    with pytest.raises(ValueError, match=r"bad.toml: unknown config key\(s\) \['data.train.folder'\]"):
        load_config(str(bad))


@pytest.mark.parametrize("override, message", [
    ("train.steps=1.5", "config key 'train.steps' must be an integer; got 1.5"),
    ("train.steps=true", "config key 'train.steps' must be an integer; got True"),
    ("optim.lr=fast", "config key 'optim.lr' must be a number; got 'fast'"),
    ("train.parallel=zero", "config key 'train.parallel' must be one of 'ddp', 'fsdp'; got 'zero'"),
    ("compare.variants=softmax", "config key 'compare.variants' must be a list of a string; got 'softmax'"),
    ("optim.betas=[0.9, 'x']", r"config key 'optim.betas\[1\]' must be a number"),
    ("train=3", "config key 'train' must be a table"),
    ("train.global_batch=6", "must be a multiple of train.micro_batch"),
    ("kd.enabled=true", "kd.enabled = true needs kd.teacher"),
])
def test_bad_values_are_refused_clearly(override, message):
    with pytest.raises(ValueError, match=message):
        load_config("tiny", [override])


def test_set_needs_key_value():
    with pytest.raises(ValueError, match="--set expects key=value"):
        load_config("tiny", ["train.steps"])


def test_presets_by_name_and_path():
    assert {"tiny", "kd-smollm2", "paper-0.5b", "paper-1b", "paper-3b"} <= set(preset_names())
    assert resolve_config_path("paper-0.5b").name == "paper-0.5b.toml"
    assert load_config(str(resolve_config_path("tiny"))) == load_config("tiny") == load_config(None)
    with pytest.raises(ValueError, match="neither a file nor a preset name; presets: .*tiny"):
        resolve_config_path("tinyy")
    for name in ("kd-smollm2", "paper-0.5b", "paper-1b", "paper-3b"):
        load_config(name)  # every preset parses and validates


def test_repository_configs_folder_is_the_packaged_presets():
    """configs/ at the root is a link to the package's presets, so there is one copy to edit."""
    assert (REPO / "configs").resolve() == (REPO / "affine_attention" / "configs").resolve()
    assert {"tiny", "tiny-ablation", "kd-smollm2", "paper-0.5b", "paper-1b", "paper-3b"} <= set(preset_names())


@pytest.mark.parametrize("preset, hf_preset, expected, overhead", [
    ("paper-0.5b", "qwen1.5-0.5b", 463_987_712, 393_216),
    ("paper-1b", "llama-3.2-1b", 1_235_814_400, 1_048_576),
    ("paper-3b", "llama-3.2-3b", 3_212_749_824, 2_064_384),
])
def test_dry_run_of_paper_presets(preset, hf_preset, expected, overhead, capsys):
    from affine_attention.cli import main

    assert main(["train", "--config", preset, "--dry-run", "--world", "8"]) == 0
    out = capsys.readouterr().out
    assert f"base (softmax) parameters: {expected:,}" in out
    assert f"overhead {overhead:>+14,}" in out  # hidden x heads x layers (paper: 0.4M / 1.0M / 2.1M)
    assert "tokens per step: 2,097,152" in out and "memory per GPU" in out
    # The TOML architecture agrees with the hf layer's preset of the same model.
    from affine_attention.hf.presets import PRESETS

    ref, mc = PRESETS[hf_preset], load_config(preset).model
    assert (mc.hidden_size, mc.intermediate_size, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.vocab_size,
            mc.tie_embeddings, mc.rope_theta) == (
        ref["hidden_size"], ref["intermediate_size"], ref["num_hidden_layers"], ref["num_attention_heads"],
        ref["num_key_value_heads"], ref["vocab_size"], ref["tie_word_embeddings"], ref["rope_theta"])


def test_smollm2_presets_separate_documents_as_smollm2_was_pretrained():
    """Every preset that reads SmolLM2's tokenizer (the KD teacher's, or a retrofit's init_from) ends documents with
    <|endoftext|>, SmolLM2's pretraining separator, not the Instruct tokenizer's eos <|im_end|> (a chat turn's end),
    so the retrofit and KD presets train on the same document boundaries."""
    from affine_attention.hf.load import SHORTHANDS

    def smollm2(spec):
        return SHORTHANDS.get(str(spec).lower(), spec) == SHORTHANDS["smollm2"]

    seen = []
    for name in preset_names():
        cfg = load_config(name)
        if smollm2(cfg.data.tokenizer) or smollm2(cfg.model.init_from):
            seen.append((name, cfg.data.separator))
    assert {name for name, _ in seen} >= {"kd-smollm2", "retrofit-smollm2"}
    assert {sep for _, sep in seen} == {"<|endoftext|>"}, seen
