"""affine_attention.eval.perplexity: exact token accounting, windows, strides, input forms, errors."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from affine_attention.eval import perplexity, read_texts
from affine_attention.text.corpus import default_tokenizer as make_tokenizer  # the packaged one

TEXTS = [
    "The river ran fast after the rain, and the old bridge shook under the carts.",
    "A small dog slept by the fire while the wind beat against the shutters.",
    "Bread, cheese and apples were laid out on the long wooden table.",
]


def make_model(tokenizer, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=len(tokenizer), max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return make_model(tok)


def stream_of(tok, texts):
    ids = []
    for text in texts:
        ids.append(tok.eos_token_id)
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
    return torch.tensor(ids)


def nll_of_prefix(model, ids, begin, t):
    """-log p(ids[t] | ids[begin:t]) by a direct forward on exactly that context."""
    with torch.no_grad():
        logits = model(input_ids=ids[begin:t][None]).logits[0, -1].float()
    return F.cross_entropy(logits[None], ids[t][None]).item()


def test_single_window_equals_direct_cross_entropy(model, tok):
    ids = stream_of(tok, TEXTS)
    result = perplexity(model, tok, TEXTS, seq_len=256)
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float()
    expected = F.cross_entropy(logits[:-1], ids[1:]).item()  # every token but the leading eos
    assert result["tokens"] == len(ids) - 1
    assert result["windows"] == 1 and result["documents"] == 3
    assert result["loss"] == pytest.approx(expected, abs=1e-5)
    assert result["ppl"] == pytest.approx(math.exp(expected), rel=1e-5)


def test_non_overlapping_windows_score_all_but_each_window_start(model, tok):
    ids = stream_of(tok, TEXTS)
    n, seq_len = len(ids), 16
    result = perplexity(model, tok, TEXTS, seq_len=seq_len, batch_size=3)
    nlls = [nll_of_prefix(model, ids, (t // seq_len) * seq_len, t) for t in range(n) if t % seq_len]
    assert result["tokens"] == len(nlls) == n - math.ceil(n / seq_len)
    assert result["loss"] == pytest.approx(sum(nlls) / len(nlls), abs=1e-5)
    assert perplexity(model, tok, TEXTS, seq_len=seq_len, stride=seq_len) == result


def test_stride_scores_each_token_once_with_enough_context(model, tok):
    ids = stream_of(tok, TEXTS)
    n, seq_len, stride = len(ids), 16, 4
    result = perplexity(model, tok, TEXTS, seq_len=seq_len, stride=stride, batch_size=5)
    # Independent reading of the rule: token t is scored in the first window [k*stride, k*stride+seq_len)
    # that contains it and where it is not the window's first token.
    nlls = []
    for t in range(1, n):
        begin = next(k * stride for k in range(n) if k * stride < t < k * stride + seq_len)
        assert begin == 0 or t - begin >= seq_len - stride  # context guarantee of the sliding window
        nlls.append(nll_of_prefix(model, ids, begin, t))
    assert result["tokens"] == n - 1
    assert result["loss"] == pytest.approx(sum(nlls) / len(nlls), abs=1e-5)


def test_batching_and_padding_do_not_change_the_result(model, tok):
    one = perplexity(model, tok, TEXTS, seq_len=20, stride=7, batch_size=1)
    many = perplexity(model, tok, TEXTS, seq_len=20, stride=7, batch_size=4)  # last batch padded
    assert one["tokens"] == many["tokens"]
    assert one["loss"] == pytest.approx(many["loss"], abs=1e-5)
    assert perplexity(model, tok, TEXTS, seq_len=20, stride=7, batch_size=4) == many  # deterministic


def test_input_forms_agree(model, tok, tmp_path):
    import datasets

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "url": "x"}) + "\n" for t in TEXTS) + "\n")
    txt = tmp_path / "doc.txt"
    txt.write_text(TEXTS[0])
    base = perplexity(model, tok, TEXTS, seq_len=32)
    assert perplexity(model, tok, str(jsonl), seq_len=32) == base
    assert perplexity(model, tok, datasets.Dataset.from_dict({"text": TEXTS}), seq_len=32) == base
    assert perplexity(model, tok, iter(TEXTS + [""]), seq_len=32) == base  # empty documents skipped
    assert perplexity(model, tok, txt, seq_len=32) == perplexity(model, tok, [TEXTS[0]], seq_len=32)
    assert read_texts(datasets.Dataset.from_dict({"body": TEXTS}), text_column="body") == TEXTS


def test_restores_training_mode_and_builds_no_graph(tok):
    model = make_model(tok).train()
    result = perplexity(model, tok, TEXTS[:1], seq_len=32)
    assert model.training and math.isfinite(result["ppl"])
    assert all(p.grad is None for p in model.parameters())


def test_random_model_is_near_uniform(model, tok):
    # A freshly initialised model predicts roughly uniformly: ppl within a factor ~2 of the vocabulary.
    ppl = perplexity(model, tok, TEXTS, seq_len=64)["ppl"]
    assert len(tok) / 2 < ppl < len(tok) * 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"seq_len": 16, "stride": 17}, "must not exceed seq_len"),
        ({"seq_len": 1}, "at least 2"),
        ({"seq_len": 512}, "max_position_embeddings"),
        ({"stride": 0}, "positive int"),
        ({"batch_size": 0}, "positive int"),
    ],
)
def test_bad_arguments(model, tok, kwargs, match):
    with pytest.raises(ValueError, match=match):
        perplexity(model, tok, TEXTS, **kwargs)


def test_bad_inputs(model, tok, tmp_path):
    import datasets

    with pytest.raises(ValueError, match="not a file"):
        perplexity(model, tok, "just some raw text", seq_len=32)
    with pytest.raises(ValueError, match="no non-empty documents"):
        perplexity(model, tok, ["", ""], seq_len=32)
    with pytest.raises(ValueError, match="expected str"):
        perplexity(model, tok, [TEXTS[0], 3], seq_len=32)
    with pytest.raises(ValueError, match="no column 'text'"):
        perplexity(model, tok, datasets.Dataset.from_dict({"body": TEXTS}), seq_len=32)
    with pytest.raises(ValueError, match="one split"):
        perplexity(model, tok, datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS})}), seq_len=32)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        perplexity(model, tok, bad, seq_len=32)


def test_tokenizer_without_eos(model, tok):
    tok = make_tokenizer()
    tok.eos_token = None
    with pytest.raises(ValueError, match="eos_token_id"):
        perplexity(model, tok, TEXTS, seq_len=32)
