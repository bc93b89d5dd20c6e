"""The embedded corpus and packaged tokenizer: splits held out by work, exact round trips, sizes."""

from __future__ import annotations

import pytest

from affine_attention.text.corpus import (
    EOS_TOKEN,
    PAD_TOKEN,
    corpus_texts,
    default_tokenizer,
    default_tokenizer_path,
    load_corpus,
)

# Measured with the committed tokenizer: train 1,499,006 tokens, validation 153,367. The bounds leave
# room for a rebuild with small cleaning changes but catch a lost work or a broken tokenizer.
MIN_TRAIN_TOKENS = 1_400_000
MIN_VALIDATION_TOKENS = 140_000


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


@pytest.fixture(scope="module")
def token_counts(tokenizer):
    return {
        split: sum(len(ids) for ids in tokenizer(corpus_texts(split))["input_ids"])
        for split in ("train", "validation")
    }


def test_splits_are_non_empty_and_disjoint_by_title():
    train, validation = load_corpus("train"), load_corpus("validation")
    assert len(train) > 30 and 3 <= len(validation) <= 4
    train_titles = {work["title"] for work in train}
    validation_titles = {work["title"] for work in validation}
    assert len(train_titles) == len(train) and len(validation_titles) == len(validation)
    assert not train_titles & validation_titles
    assert all(work["text"].strip() for work in train + validation)


def test_validation_works_do_not_appear_in_train():
    # Slicing one work into both splits would share passages; holding out whole works shares none.
    train_text = "\n".join(corpus_texts("train"))
    for text in corpus_texts("validation"):
        middle = len(text) // 2
        assert text[middle : middle + 300] not in train_text


def test_unknown_split_is_rejected_with_the_valid_names():
    with pytest.raises(ValueError, match="'train', 'validation'"):
        load_corpus("test")
    with pytest.raises(ValueError, match="'train', 'validation'"):
        corpus_texts("valid")


def test_load_corpus_returns_copies_of_the_cache():
    first = load_corpus("validation")
    first[0]["text"] = ""
    assert load_corpus("validation")[0]["text"]
    assert corpus_texts("validation") == [work["text"] for work in load_corpus("validation")]


def test_tokenizer_files_are_packaged():
    names = {path.name for path in default_tokenizer_path().iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names


@pytest.mark.parametrize(
    "text",
    [
        corpus_texts("validation")[0][:20_000],
        corpus_texts("train")[-1][-5_000:],
        "  leading spaces, double  spaces , trailing space \n\n\n\tTabs\r\nand CRLF ",
        "Non-ASCII survives byte-level BPE: naïve café, em—dash, 東京, 🎭.",
    ],
    ids=["validation", "train", "whitespace", "unicode"],
)
def test_tokenizer_round_trips_text_exactly(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens(tokenizer):
    assert len(tokenizer) == 4096
    assert tokenizer.eos_token == tokenizer.bos_token == EOS_TOKEN
    assert tokenizer.pad_token == PAD_TOKEN
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert tokenizer.bos_token_id == tokenizer.eos_token_id
    # Packing inserts the separator itself; the tokenizer must not add it behind its back.
    ids = tokenizer("To be, or not to be")["input_ids"]
    assert tokenizer.eos_token_id not in ids and tokenizer.pad_token_id not in ids
    assert tokenizer.encode(EOS_TOKEN) == [tokenizer.eos_token_id]


def test_token_counts(token_counts):
    assert token_counts["train"] > MIN_TRAIN_TOKENS
    assert token_counts["validation"] > MIN_VALIDATION_TOKENS
    # Byte-level BPE with 4k merges on English verse lands near 3 bytes per token; far outside
    # that means the merges were not learned or the text was mangled.
    n_bytes = sum(len(text.encode("utf-8")) for text in corpus_texts("train"))
    assert 2.5 < n_bytes / token_counts["train"] < 4.0


def test_packaged_data_stays_small():
    # The corpus and tokenizer ship in every wheel; a careless rebuild must not bloat it.
    data_dir = default_tokenizer_path().parent
    files = [*data_dir.glob("corpus-*.jsonl.xz"), *default_tokenizer_path().iterdir()]
    total = sum(path.stat().st_size for path in files)
    assert total < 2.5 * 1024 * 1024
