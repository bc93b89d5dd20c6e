"""Presets reproduce the published shapes and the paper's parameter overheads; the `params` command prints them."""
from __future__ import annotations

import pytest
from test_hf_common import tiny  # noqa: F401  (skips without transformers, registers the model types)

from affine_attention.cli import main
from affine_attention.hf.cli import overhead_table
from affine_attention.hf.presets import PAPER_PRESETS, parameter_overheads, preset_config


def test_paper_overheads():
    """Table 1/2 of the paper: affine 0.4M / 1.0M / 2.1M; gated 67.1M (1B) and 264.2M (3B)."""
    got = {p: parameter_overheads(p, ["affine", "gated", "sink", "softmax"]) for p in PAPER_PRESETS}
    base = {p: b for p, (b, _) in got.items()}
    extra = {p: e for p, (_, e) in got.items()}
    assert base == {"qwen1.5-0.5b": 463_987_712, "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824}
    assert [round(extra[p]["affine"] / 1e6, 1) for p in PAPER_PRESETS] == [0.4, 1.0, 2.1]
    assert extra["llama-3.2-1b"]["affine"] == 2048 * 32 * 16  # hidden x heads x layers
    assert [round(extra[p]["gated"] / 1e6, 1) for p in PAPER_PRESETS[1:]] == [67.1, 264.2]
    assert all(extra[p]["softmax"] == 0 and extra[p]["sink"] < 1000 for p in PAPER_PRESETS)


def test_published_shapes():
    llama1b = preset_config("llama-3.2-1b")
    assert (llama1b.hidden_size, llama1b.num_hidden_layers, llama1b.num_attention_heads,
            llama1b.num_key_value_heads, llama1b.intermediate_size, llama1b.vocab_size) == (2048, 16, 32, 8, 8192, 128256)
    assert llama1b.tie_word_embeddings and llama1b.rope_parameters["rope_type"] == "llama3"
    assert llama1b.rope_parameters["rope_theta"] == 500000.0
    qwen = preset_config("qwen1.5-0.5b")
    assert (qwen.model_type, qwen.hidden_size, qwen.num_hidden_layers, qwen.num_attention_heads,
            qwen.intermediate_size, qwen.vocab_size, qwen.tie_word_embeddings) == ("qwen2", 1024, 24, 16, 2816,
                                                                                 151936, True)
    llama3b = preset_config("llama-3.2-3b", num_hidden_layers=2)  # overrides apply
    assert (llama3b.hidden_size, llama3b.num_attention_heads, llama3b.num_hidden_layers) == (3072, 24, 2)
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("llama-70b")


def test_params_command(capsys):
    assert main(["params", "--preset", "tiny-llama", "--variant", "affine", "--variant", "gated"]) == 0
    out = capsys.readouterr().out
    assert "| preset | base params | affine | gated |" in out
    assert "| tiny-llama |" in out and "| 512 | 8,192 |" in out  # 64 x 4 x 2 and 64 x 64 x 2
    assert main(["params", "--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_overhead_table_formats_millions():
    table = overhead_table(["llama-3.2-1b"], ["affine", "gated"])
    assert table.splitlines()[-1] == "| llama-3.2-1b | 1,235.8M | 1.0M | 67.1M |"
