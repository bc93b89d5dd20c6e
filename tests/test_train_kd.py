"""KD losses against hand computations, the top-k approximation, the teacher cache (same values as a live
teacher, no model load when cached) and refusal of a teacher with another vocabulary."""
from __future__ import annotations

import math

import pytest
import torch

from affine_attention.train.config import KDConfig
from affine_attention.train.kd import Teacher, ce_loss, kd_loss_full, kd_loss_topk, vocab_fingerprint
from affine_attention.train.teacher_cache import TeacherCache


def _hand_kl(student, teacher, T):
    """sum_v p log(p / q) per token with plain Python floats, averaged over tokens, times T^2."""
    total, n = 0.0, 0
    for s_row, t_row in zip(student.reshape(-1, student.shape[-1]).tolist(),
                            teacher.reshape(-1, teacher.shape[-1]).tolist()):
        zs = sum(math.exp(x / T) for x in s_row)
        zt = sum(math.exp(x / T) for x in t_row)
        for xs, xt in zip(s_row, t_row):
            p, q = math.exp(xt / T) / zt, math.exp(xs / T) / zs
            total += p * math.log(p / q)
        n += 1
    return T * T * total / n


@pytest.mark.parametrize("T", [1.0, 2.0, 0.5])
def test_full_kd_loss_matches_hand_computation(T):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, 7, generator=g, dtype=torch.float64), torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    assert float(kd_loss_full(s, t, T)) == pytest.approx(_hand_kl(s, t, T), rel=1e-6)
    assert float(kd_loss_full(t, t, T)) == pytest.approx(0.0, abs=1e-6)


def test_topk_kd_loss_matches_hand_computation_and_full_when_k_is_v():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(4, 9, generator=g), torch.randn(4, 9, generator=g)
    T, k = 1.5, 3
    values, indices = t.topk(k, dim=-1)
    total = 0.0
    for row in range(4):
        zs = sum(math.exp(x / T) for x in s[row].tolist())
        zt = sum(math.exp(v / T) for v in values[row].tolist())
        for v, j in zip(values[row].tolist(), indices[row].tolist()):
            p = math.exp(v / T) / zt  # teacher renormalised on its top-k
            log_q = s[row, j].item() / T - math.log(zs)  # student: full-vocabulary log-probability
            total += p * (math.log(p) - log_q)
    assert float(kd_loss_topk(s, values, indices, T)) == pytest.approx(T * T * total / 4, rel=1e-5)
    v_all, i_all = t.topk(9, dim=-1)
    assert float(kd_loss_topk(s, v_all, i_all, T)) == pytest.approx(float(kd_loss_full(s, t, T)), rel=1e-5)


def test_ce_loss_is_mean_token_cross_entropy():
    logits = torch.tensor([[[0.0, 1.0], [2.0, 0.0]]])
    targets = torch.tensor([[1, 1]])
    expected = (-math.log(math.e / (1 + math.e)) - math.log(1 / (1 + math.e ** 2))) / 2
    assert float(ce_loss(logits, targets)) == pytest.approx(expected, rel=1e-6)


def test_cache_round_trip_and_reopen(tmp_path):
    key = {"data": "x", "k": 2}
    cache = TeacherCache(str(tmp_path), key, shard_sequences=3)
    vals, idx = torch.randn(4, 5, 2), torch.randint(0, 9, (4, 5, 2), dtype=torch.int32)
    cache.put([10, 11, 12], vals[:3], idx[:3])  # reaches shard_sequences: written
    cache.put([13], vals[3:], idx[3:])  # pending
    assert cache.get([13])[0][0].equal(vals[3])
    cache.flush()
    shards = sorted(cache.dir.glob("shard-*.safetensors"))
    assert len(shards) == 2 and not list(cache.dir.glob(".*tmp"))
    again = TeacherCache(str(tmp_path), key)
    got = again.get([12, 99, 10])
    assert got[1] is None
    assert got[0][0].equal(vals[2]) and got[0][1].equal(idx[2]) and got[2][0].equal(vals[0])
    assert TeacherCache(str(tmp_path), {"data": "y", "k": 2}).dir != again.dir  # other data: other namespace
    shards[0].write_bytes(b"garbage")
    with pytest.raises(ValueError, match="unreadable.*delete it"):
        TeacherCache(str(tmp_path), key)


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """Tiny local teachers: one with the default tokenizer, one with an extra token, one with a wider head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from affine_attention.train.pretrained import load_tokenizer

    root = tmp_path_factory.mktemp("teachers")
    out = {}
    for name, extra_token, vocab in (("same", False, 4096), ("other_vocab", True, 4097), ("wide", False, 5000)):
        tok = load_tokenizer("default")
        if extra_token:
            tok.add_tokens(["<|extra|>"])
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def student_tok():
    from affine_attention.train.pretrained import load_tokenizer

    return load_tokenizer("default")


def _logits(targets):
    """The live teacher's full logits (B, T, V) from its hidden states and head."""
    head = targets["head"]
    return head.post(targets["hidden"] @ head.weight.t())


def _teacher(spec, student_tok, tmp_path, **kw):
    cfg = KDConfig(enabled=True, teacher=spec, cache_dir=str(tmp_path / "cache"), **kw)
    return Teacher(cfg, student_tok=student_tok, student_tok_spec="default", student_vocab=4096, data_key="d",
                   seq_len=8, device=torch.device("cpu"))


def test_teacher_with_another_vocabulary_is_refused(teachers, student_tok, tmp_path):
    with pytest.raises(ValueError, match=r"vocabulary differs from the student's.*4097-token.*4096-token.*"
                                         r"set data.tokenizer = .*other_vocab.* and model.vocab_size = 4097"):
        _teacher(teachers["other_vocab"], student_tok, tmp_path)
    with pytest.raises(ValueError, match="outputs 5000 logits per token but the student 4096; set model.vocab_size"):
        _teacher(teachers["wide"], student_tok, tmp_path)


def test_cached_teacher_equals_live_and_skips_the_model(teachers, student_tok, tmp_path):
    g = torch.Generator().manual_seed(0)
    inputs, ids = torch.randint(0, 4096, (3, 8), generator=g), torch.tensor([5, 1, 7])
    live = _teacher(teachers["same"], student_tok, tmp_path, top_k=4)
    want = live.targets(inputs, ids)
    first = _teacher(teachers["same"], student_tok, tmp_path, top_k=4, cache=True)
    got = first.targets(inputs, ids)
    assert torch.equal(got["values"], want["values"]) and torch.equal(got["indices"], want["indices"])
    first.flush()
    second = _teacher(teachers["same"], student_tok, tmp_path, top_k=4, cache=True)
    again = second.targets(inputs[[2, 0]], ids[[2, 0]])
    assert second._model is None  # everything came from disk
    assert torch.equal(again["values"], want["values"][[2, 0]])
    full = _logits(_teacher(teachers["same"], student_tok, tmp_path).targets(inputs, ids))
    assert full.shape == (3, 8, 4096)
    assert torch.equal(full.topk(4, dim=-1).values, want["values"])


def test_vocab_fingerprint_sees_one_token_more(student_tok):
    from affine_attention.train.pretrained import load_tokenizer

    other = load_tokenizer("default")
    assert vocab_fingerprint(other) == vocab_fingerprint(student_tok)
    other.add_tokens(["<|x|>"])
    assert vocab_fingerprint(other)[0] != vocab_fingerprint(student_tok)[0]


def test_teacher_sees_the_students_document_boundaries(teachers, student_tok, tmp_path):
    """Under document masking the teacher's logits of a packed row are those of each document alone."""
    cfg = KDConfig(enabled=True, teacher=teachers["same"], cache_dir=str(tmp_path / "cache"))
    sep = 7
    teacher = Teacher(cfg, student_tok=student_tok, student_tok_spec="default", student_vocab=4096, data_key="d",
                      seq_len=10, device=torch.device("cpu"), doc_sep=sep)
    a, b = torch.tensor([11, 12, 13, sep]), torch.tensor([21, 22, 23, 24, sep, 31])
    packed = _logits(teacher.targets(torch.cat([a, b])[None], torch.tensor([0])))[0]
    alone = [_logits(teacher.targets(x[None], torch.tensor([0])))[0] for x in (a, b[:5], b[5:])]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)
    plain = Teacher(cfg, student_tok=student_tok, student_tok_spec="default", student_vocab=4096, data_key="d",
                    seq_len=10, device=torch.device("cpu"))
    across = _logits(plain.targets(torch.cat([a, b])[None], torch.tensor([0])))[0]
    assert not torch.allclose(across[4:], torch.cat(alone)[4:], atol=1e-4)  # without it, attention crosses


def test_a_top_k_above_the_teachers_vocabulary_is_refused_by_name(teachers, student_tok, tmp_path):
    # It once reached torch.topk inside the first step as "selected index k out of range".
    with pytest.raises(ValueError, match=r"kd.top_k = 4097 is more than the 4096 logits teacher .*same' makes per "
                                         r"token; set kd.top_k to at most 4096, or to 0"):
        _teacher(teachers["same"], student_tok, tmp_path, top_k=4097)
    assert _teacher(teachers["same"], student_tok, tmp_path, top_k=4096).cfg.top_k == 4096


@pytest.mark.parametrize("top_k", [0, 4])
def test_a_teacher_with_a_nan_weight_is_named_not_reported_as_a_divergence(teachers, student_tok, tmp_path, top_k):
    # Its KD loss was nan from the first step, which training reported as "lower optim.lr".
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teachers["same"])
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[3, 5] = float("nan")
    model.save_pretrained(tmp_path / "nan_teacher")
    student_tok.save_pretrained(tmp_path / "nan_teacher")
    teacher = _teacher(str(tmp_path / "nan_teacher"), student_tok, tmp_path, top_k=top_k)
    with pytest.raises(ValueError, match=r"KD teacher .*nan_teacher' has non-finite weights \(1 nan/inf values in "
                                         r"model.layers.0.mlp.up_proj.weight, \(32, 16\)\)"):
        teacher.targets(torch.zeros(1, 8, dtype=torch.long), torch.tensor([0]))
