"""The chunked head loss (train/kd_chunked.py) equals the full-logits losses of train/kd.py in float64: values and
gradients (final hidden states, the head's weight, a tiny model's parameters), full and top-k KD, the CE mix,
temperature, the families' logit transforms; and `final_hidden` + `output_head` reproduce every family's logits."""
from __future__ import annotations

import pytest
import torch
from test_hf_common import FAMILIES, tiny

from affine_attention.train.kd import ce_loss, kd_loss_full, kd_loss_topk
from affine_attention.train.kd_chunked import OutputHead, final_hidden, head_loss, output_head

N, H, V = 11, 6, 23  # 11 tokens: chunks of 4 leave a short last one


def _reference(z, y, teacher_logits, kind, T, alpha):
    """Today's loss on full logits z (N, V)."""
    ce = ce_loss(z[None], y[None])
    if kind == "ce":
        return ce
    if kind == "full":
        kd = kd_loss_full(z, teacher_logits, T)
    else:
        values, indices = teacher_logits.topk(5, dim=-1)
        kd = kd_loss_topk(z, values, indices, T)
    return alpha * kd + (1 - alpha) * ce


def _teacher_targets(teacher_logits, kind):
    if kind == "ce":
        return None
    if kind == "full":
        return {"logits": teacher_logits}
    values, indices = teacher_logits.topk(5, dim=-1)
    return {"values": values, "indices": indices.to(torch.int32)}


@pytest.mark.parametrize("kind,T,alpha,post,chunk", [
    ("full", 1.0, 1.0, {}, 4), ("full", 2.0, 0.7, {}, 4), ("topk", 0.5, 1.0, {}, 3), ("topk", 1.0, 0.4, {}, 0),
    ("ce", 1.0, 1.0, {}, 5), ("full", 1.5, 0.5, {"softcap": 0.8}, 4), ("full", 1.0, 1.0, {"divide": 2.5}, 4),
    ("topk", 2.0, 0.6, {"softcap": 1.2, "divide": 0.7}, 2)])
def test_chunked_equals_full_loss_values_and_gradients_in_float64(kind, T, alpha, post, chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (N,), generator=g)
    teacher_logits = 2 * torch.randn(N, V, generator=g, dtype=torch.float64)
    head = OutputHead(weight, **post)
    loss, ce, kd = head_loss(hidden, head, y, teacher=_teacher_targets(teacher_logits, kind), temperature=T,
                             kd_alpha=alpha, chunk=chunk)
    gh, gw = torch.autograd.grad(2.0 * loss, (hidden, weight))  # a non-unit upstream gradient

    ref = _reference(head.post(hidden @ weight.t()), y, teacher_logits, kind, T, alpha)
    rh, rw = torch.autograd.grad(2.0 * ref, (hidden, weight))
    assert loss.dtype == torch.float64
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-10, atol=1e-12)
    z = head.post(hidden @ weight.t()).detach()
    if kind != "ce" and alpha == 1.0 and T != 1.0:
        assert ce.isnan()  # skipped: its weight is 0 and at T != 1 it would cost a pass of its own
    else:
        assert float(ce) == pytest.approx(float(ce_loss(z[None], y[None])), rel=1e-12)
    if kind == "ce":
        assert float(kd) == 0.0
    else:
        assert float(kd) == pytest.approx(float(_reference(z, y, teacher_logits, kind, T, 1.0)), rel=1e-12)


@pytest.mark.parametrize("T,alpha,post", [(1.0, 1.0, {}), (2.0, 0.7, {}), (1.5, 0.5, {"softcap": 0.8})])
def test_the_kl_in_blocks_of_vocabulary_rows_equals_the_full_loss(monkeypatch, T, alpha, post):
    from affine_attention.train import kd_chunked

    monkeypatch.setattr(kd_chunked, "_KL_BLOCK", 10)  # chunks of 4 tokens: blocks of 2 rows, a last one of 1 (V 23)
    test_chunked_equals_full_loss_values_and_gradients_in_float64("full", T, alpha, post, 4)


def test_the_teachers_logits_are_made_chunk_by_chunk_from_its_hidden_states():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    t_hidden, t_weight = torch.randn(N, 4, generator=g, dtype=torch.float64), torch.randn(V, 4, generator=g,
                                                                                            dtype=torch.float64)
    y = torch.randint(0, V, (N,), generator=g)
    t_head = OutputHead(t_weight, softcap=3.0)
    loss, _, _ = head_loss(hidden, OutputHead(weight), y, teacher={"hidden": t_hidden, "head": t_head}, chunk=3)
    ref = kd_loss_full(hidden @ weight.t(), t_head.post(t_hidden @ t_weight.t()), 1.0)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, hidden)[0], torch.autograd.grad(ref, hidden)[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_final_hidden_and_output_head_give_each_familys_logits(family):
    model = tiny(family)  # float32: the MoE families' grouped matmul has no float64
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids).logits
    head = output_head(model)
    got = head.post(final_hidden(model, {"input_ids": ids}) @ head.weight.t())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if family in ("gemma2", "granite"):
        assert (head.softcap or head.divide) is not None  # the transform the test would miss if the tiny one is 1


def test_gradients_through_a_tiny_model_with_tied_embeddings_match_the_full_loss():
    model = tiny("llama", "affine", dtype=torch.float64, tie_word_embeddings=True).train()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    g = torch.Generator().manual_seed(3)
    ids, y = torch.randint(0, 128, (2, 9), generator=g), torch.randint(0, 128, (2, 9), generator=g)
    teacher = torch.randn(2, 9, 128, generator=g, dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    loss, _, _ = head_loss(final_hidden(model, {"input_ids": ids}), output_head(model), y,
                           teacher={"logits": teacher}, temperature=2.0, kd_alpha=0.8, chunk=5)
    got = torch.autograd.grad(loss, params)
    logits = model(input_ids=ids).logits
    ref = 0.8 * kd_loss_full(logits, teacher, 2.0) + 0.2 * ce_loss(logits, y)
    want = torch.autograd.grad(ref, params)
    assert float(loss) == pytest.approx(float(ref.detach()), rel=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_the_configs_default_chunk_is_the_losss():
    from affine_attention.train.config import TrainConfig
    from affine_attention.train.kd_chunked import CHUNK_TOKENS

    assert TrainConfig().loss_chunk_tokens == CHUNK_TOKENS


def test_a_negative_chunk_is_refused():
    with pytest.raises(ValueError, match="chunk must be >= 0"):
        head_loss(torch.zeros(2, 3), OutputHead(torch.zeros(4, 3)), torch.zeros(2, dtype=torch.long), chunk=-1)


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: the head's final softcap
def test_heldout_loss_in_chunks_equals_the_full_logits_cross_entropy(family):
    import contextlib

    import torch.nn.functional as F

    from affine_attention.train.steps import heldout_loss

    seqs = torch.randint(0, 128, (5, 10), generator=torch.Generator().manual_seed(4))
    for dtype, rel in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        model = tiny(family, "affine", dtype=dtype)
        with torch.no_grad():  # what heldout_loss computed before it was chunked: whole logits per batch
            want = sum(float(F.cross_entropy(model(input_ids=seqs[i:i + 2, :-1]).logits.to(dtype).flatten(0, 1),
                                             seqs[i:i + 2, 1:].flatten(), reduction="sum"))
                       for i in range(0, 5, 2)) / seqs[:, 1:].numel()
        got = heldout_loss(model, seqs, 2, contextlib.nullcontext, chunk=7)  # chunks across rows and batches
        assert got == pytest.approx(want, rel=rel), (dtype, got, want)
