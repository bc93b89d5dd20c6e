"""Packing: separators at document boundaries, one shared token between consecutive sequences, deterministic
order per seed, exact resume of the position (in memory and streamed), and the rank split of a global batch."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from affine_attention.train.config import DataConfig, SourceConfig
from affine_attention.train.data import (PackedArray, PackedStream, TrainBatches, eval_sequences, open_source,
                                         separator_id, token_stream, tokenize_documents)


@pytest.fixture(scope="module")
def tok():
    from affine_attention.train.pretrained import load_tokenizer

    return load_tokenizer("default")


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    docs = [f"Document number {i}. " + "To be or not to be. " * (3 + i % 5) for i in range(40)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path, docs


def test_documents_end_with_the_separator_and_concatenate_in_order(tok, docs_file, tmp_path):
    path, docs = docs_file
    src = SourceConfig(kind="files", paths=[str(path)])
    tokens, _ = token_stream(src, tok, str(tmp_path), tok.eos_token_id)
    expected = [t for d in docs for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    assert tokens.tolist() == expected
    assert int((tokens == tok.eos_token_id).sum()) == len(docs)
    again, _ = token_stream(src, tok, str(tmp_path), tok.eos_token_id)  # from the .npy cache
    assert np.array_equal(tokens, again)


def test_sequences_share_one_token_and_cover_the_stream(tok, docs_file, tmp_path):
    path, _ = docs_file
    cfg = DataConfig(seq_len=16, token_cache_dir=str(tmp_path))
    src = open_source(SourceConfig(kind="files", paths=[str(path)]), tok, cfg, seed=0, shuffle=False)
    rows, ids = src.take(src.n)
    assert ids.tolist() == list(range(src.n))
    assert torch.equal(rows[:-1, -1], rows[1:, 0])  # the last target of one is the first input of the next
    stream = torch.cat([rows[0]] + [r[1:] for r in rows[1:]])
    assert torch.equal(stream, torch.from_numpy(src.tokens[: len(stream)].astype(np.int64)))


def test_order_is_deterministic_per_seed_and_epoch(tok, docs_file, tmp_path):
    path, _ = docs_file
    cfg = DataConfig(seq_len=16, token_cache_dir=str(tmp_path))
    srcs = [open_source(SourceConfig(kind="files", paths=[str(path)]), tok, cfg, seed=s, shuffle=True)
            for s in (0, 0, 1)]
    a, b, c = (s.take(2 * s.n)[1] for s in srcs)
    n = srcs[0].n
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert sorted(a[:n].tolist()) == list(range(n)) and sorted(a[n:].tolist()) == list(range(n))
    assert not torch.equal(a[:n], a[n:])  # every epoch has its own permutation


def test_array_resume_continues_exactly(tok, docs_file, tmp_path):
    path, _ = docs_file
    cfg = DataConfig(seq_len=16, token_cache_dir=str(tmp_path))
    src_cfg = SourceConfig(kind="files", paths=[str(path)])
    full = open_source(src_cfg, tok, cfg, seed=3, shuffle=True)
    whole = full.take(full.n + 7)[0]
    first = open_source(src_cfg, tok, cfg, seed=3, shuffle=True)
    part = first.take(full.n - 3)[0]
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    resumed = open_source(src_cfg, tok, cfg, seed=3, shuffle=True)
    resumed.load_state_dict(state)
    assert torch.equal(torch.cat([part, resumed.take(10)[0]]), whole)
    other = open_source(src_cfg, tok, DataConfig(seq_len=8, token_cache_dir=str(tmp_path)), seed=3, shuffle=True)
    with pytest.raises(ValueError, match="different data"):
        other.load_state_dict(state)


def test_stream_packing_and_resume_mid_document(tok, docs_file):
    path, docs = docs_file
    src = SourceConfig(kind="hub", name="json", paths=[str(path)], split="train")  # datasets streaming, offline
    sep = tok.eos_token_id
    full = PackedStream(src, tok, 16, sep)
    n = (sum(len(x) for x in tokenize_documents(tok, docs, sep)) - 1) // 16
    rows, ids = full.take(n + 5)  # wraps into a second epoch
    assert ids.tolist() == list(range(n)) + list(range(5))
    assert torch.equal(rows[n:], rows[:5])  # every epoch yields the same sequences
    first = PackedStream(src, tok, 16, sep)
    part = first.take(7)[0]
    state = json.loads(json.dumps(first.state_dict()))
    assert state["docs"] > 0 and state["buffer"]  # stopped with tokens of a document still pending
    resumed = PackedStream(src, tok, 16, sep)
    resumed.load_state_dict(state)
    assert torch.equal(torch.cat([part, resumed.take(n - 2)[0]]), rows[: n + 5])


def test_rank_rows_form_the_global_batch_round_by_round():
    class Counter:
        def take(self, count):
            rows = torch.arange(count)[:, None].repeat(1, 3)
            return rows, torch.arange(count)

        def state_dict(self):
            return {}

    # global 8, micro 2, 2 ranks: rounds are global rows [0..3] and [4..7]; rank r takes rows 2r, 2r+1 of each.
    got = [TrainBatches(Counter(), 8, 2, r, 2).next()[1].tolist() for r in range(2)]
    assert got == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # a single process with micro_batch = 2 x 2 sees the same rows per forward round
    assert TrainBatches(Counter(), 8, 4, 0, 1).next()[1].tolist() == list(range(8))
    with pytest.raises(ValueError, match="multiple"):
        TrainBatches(Counter(), 6, 2, 0, 2)


def test_eval_sequences_refuse_too_few(tok, docs_file, tmp_path):
    path, _ = docs_file
    cfg = DataConfig(seq_len=16, token_cache_dir=str(tmp_path))
    src = SourceConfig(kind="files", paths=[str(path)])
    n = open_source(src, tok, cfg, 0, shuffle=False).n
    assert eval_sequences(src, tok, cfg, n).shape == (n, 17)
    with pytest.raises(ValueError, match="holds only"):
        eval_sequences(src, tok, cfg, n + 1)


def test_separator_must_be_a_token(tok):
    assert separator_id(tok, "") == tok.eos_token_id
    assert separator_id(tok, "<|pad|>") == tok.pad_token_id
    with pytest.raises(ValueError, match="not a token"):
        separator_id(tok, "<|no such token|>")


def test_corpus_source_is_the_default_and_packs(tok, tmp_path):
    cfg = DataConfig(seq_len=128, token_cache_dir=str(tmp_path))
    src = open_source(cfg.eval, tok, cfg, 0, shuffle=False)
    assert isinstance(src, PackedArray) and src.n > 1000  # ~153k validation tokens
    assert int((src.tokens == tok.eos_token_id).sum()) == 4  # four held-out works, one separator each
