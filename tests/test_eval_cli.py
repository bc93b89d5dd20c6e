"""`affine-attention eval`: argument handling and an offline end-to-end run on a saved tiny model."""

import argparse
import json
import subprocess
import sys

import pytest
import torch

from affine_attention.eval import cli
from affine_attention.text.corpus import default_tokenizer as make_tokenizer  # the packaged one


def parse(argv):
    parser = argparse.ArgumentParser(prog="affine-attention")
    cli.add_commands(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=len(tok), max_position_embeddings=512,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    folder = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_eval_end_to_end(model_dir, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # outside any git repository, where lm-eval's `git describe` used to complain
    texts = tmp_path / "heldout.jsonl"
    lines = (json.dumps({"text": f"Line {i}: the quick brown fox jumps over the lazy dog."}) for i in range(8))
    texts.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "results"
    args = parse(["eval", "--model", str(model_dir), "--tasks", "fixture_piqa,fixture_c4", "--limit", "4",
                  "--ppl", str(texts), "--seq-len", "64", "--stride", "32", "--batch-size", "4", "--out", str(out)])
    assert args.func(args) == 0
    printed, err = capfd.readouterr()
    assert "neither marked as CausalLM" not in err and "not a git repository" not in err
    assert f"loading model {model_dir}: done in" in err
    results = json.loads((out / "results.json").read_text())
    assert set(results["tasks"]) == {"fixture_piqa", "fixture_c4"}
    assert results["tasks"]["fixture_piqa"]["samples"] == 4 and 0 <= results["tasks"]["fixture_piqa"]["acc"] <= 1
    assert results["perplexity"]["source"] == str(texts) and results["perplexity"]["stride"] == 32
    assert results["perplexity"]["ppl"] > 1 and results["config"]["model"] == str(model_dir)
    assert (out / "results.md").read_text() in printed and "fixture_piqa" in printed


def test_eval_ppl_only(model_dir, tmp_path, capsys):
    text = tmp_path / "doc.txt"
    text.write_text("It was a bright cold day, and the clocks were striking the hour. " * 20)
    args = parse(["eval", "--model", str(model_dir), "--ppl", str(text), "--seq-len", "128"])
    assert args.func(args) == 0
    assert "| perplexity source |" in capsys.readouterr().out


def test_ppl_without_seq_len_uses_the_models_position_limit(model_dir, tmp_path, capsys):
    """The README's `eval --ppl FILE` names no window: on a model with fewer positions than the default 1024 (this
    one 512; a default compare checkpoint 32) it measures windows of the model's length, as --seq-len would."""
    import json

    text = tmp_path / "doc.txt"
    text.write_text("It was a bright cold day, and the clocks were striking the hour. " * 200)
    got = {}
    for name, extra in (("default", []), ("explicit", ["--seq-len", "512"])):
        args = parse(["eval", "--model", str(model_dir), "--ppl", str(text), "--out", str(tmp_path / name), *extra])
        assert args.func(args) == 0
        got[name] = json.loads((tmp_path / name / "results.json").read_text())["perplexity"]
        said = capsys.readouterr()
        assert ("windows of 512 tokens, the model's max_position_embeddings" in said.err) == (name == "default")
    assert got["default"]["tokens"] > 512 and got["default"]["ppl"] == got["explicit"]["ppl"]


def test_argument_errors(model_dir, tmp_path):
    with pytest.raises(ValueError, match="nothing to do"):
        args = parse(["eval", "--model", str(model_dir)])
        args.func(args)
    with pytest.raises(ValueError, match="not a local model directory"):
        args = parse(["eval", "--model", str(tmp_path), "--tasks", "fixtures"])
        args.func(args)
    with pytest.raises(ValueError, match="does not exist"):
        args = parse(["eval", "--model", str(model_dir), "--ppl", str(tmp_path / "missing.txt")])
        args.func(args)
    assert parse(["eval", "--model", "m", "--tasks", "x", "--limit", "0.5"]).limit == 0.5
    assert parse(["eval", "--model", "m", "--tasks", "x", "--limit", "3"]).limit == 3
    for bad in ("1.5", "0", "-2", "many"):
        with pytest.raises(SystemExit):
            parse(["eval", "--model", "m", "--tasks", "x", "--limit", bad])


def test_task_names_and_a_missing_tokenizer_fail_before_the_model_loads(model_dir, tmp_path, monkeypatch):
    import shutil

    from affine_attention.hf import load

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(load, "load_model", no_load)
    args = parse(["eval", "--model", str(model_dir), "--tasks", "fixture_piqa,arc_eazy", "--limit", "2"])
    with pytest.raises(ValueError, match=r"unknown task\(s\): 'arc_eazy' \(did you mean arc_easy"):
        args.func(args)
    bare = tmp_path / "no_tokenizer"
    bare.mkdir()
    for f in model_dir.iterdir():
        if f.name in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, bare / f.name)
    args = parse(["eval", "--model", str(bare), "--tasks", "fixtures"])
    with pytest.raises(ValueError, match="has no tokenizer .* pass --tokenizer DIR"):
        args.func(args)


def test_cli_module_imports_cheaply():
    code = (
        "import sys, affine_attention.eval.cli;"
        "heavy = [m for m in ('lm_eval', 'datasets') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
