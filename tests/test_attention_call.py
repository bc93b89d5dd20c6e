"""The per-call object from the transformers seam to the kernel: per-forward context that no decoder can drop (packed
documents ride in attention_mask), the training logit probe reading the same call as the analysis recorder, a user's
own key mask keeping its meaning under torch.compile, and the score hook (any elementwise score function) applied
by the backends that declare it and refused by the others."""
from __future__ import annotations

import pytest
import torch
from test_hf_common import VOCAB, tiny
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from affine_attention.analysis.capture import AttentionRecorder
from affine_attention.ops import softmax_attention_reference
from affine_attention.ops.attention import attend_call
from affine_attention.ops.backends import use_backend
from affine_attention.ops.call import AttentionCall, Score, Softcap
from affine_attention.train.metrics import qk_logit_sums
from affine_attention.train.packing import model_inputs

LENGTHS = [5, 8, 1, 6]


class KwargsDroppingLayer(LlamaDecoderLayer):
    """A real decoder layer that calls self_attn without **kwargs, as StableLM's does: whatever transformers hands
    the layer besides its named arguments never reaches the attention function."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        # No cache is passed on (the test runs with use_cache=False): its keyword is named differently across the
        # supported transformers versions (past_key_values, cache).
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                          position_ids=position_ids, position_embeddings=position_embeddings)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


def _packed(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENGTHS]
    return docs, torch.cat(docs)[None], torch.cat([torch.arange(n) for n in LENGTHS])[None]


@pytest.mark.parametrize("variant", ["softmax", "affine"])
def test_a_decoder_that_drops_kwargs_still_attends_within_each_document(variant):
    """Packed rows through a decoder whose layers drop **kwargs: exactly the per-document forwards (the documents
    ride in attention_mask, which every layer forwards by name), never attention across documents."""
    model = tiny("llama", variant)
    for layer in model.model.layers:
        layer.__class__ = KwargsDroppingLayer
    docs, ids, pos = _packed()
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=d[None], use_cache=False).logits[0] for d in docs])
        across = model(input_ids=ids, use_cache=False).logits[0]  # the wrong answer: one long document
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert float((across - alone).abs().max()) > 1e-3  # the test can tell the two apart


def _no_autocast():
    return torch.autocast("cpu", enabled=False)


@pytest.mark.parametrize("form", ["packed", "padded"])
def test_training_probe_equals_the_recorder_on_a_windowed_model(form):
    """The training logit probe counts exactly the query-key pairs each layer's softmax used (its AttentionCall:
    window, documents, padding, softcap), as the analysis recorder does: equal per layer."""
    model = tiny("gemma2", "affine")  # a 4-token window on alternate layers, and a logit softcap
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, VOCAB, (2, 14), generator=gen)
    if form == "packed":
        tokens[:, [4, 9]] = 2  # separators: documents under document masking
        inputs = model_inputs(tokens, 2)
    else:
        mask = torch.ones_like(tokens)
        mask[0, 10:] = 0  # right padding
        mask[1, :3] = 0  # left padding
        inputs = {"input_ids": tokens, "attention_mask": mask}
    sums = qk_logit_sums(model, inputs, _no_autocast)  # (L, 3): per layer sum, sum |.|, count
    with AttentionRecorder(model, chunk=5) as rec, torch.no_grad():
        model(**inputs)
    records = rec.results()
    assert len(records) == sums.shape[0]
    for layer, r in zip(sums, records):
        mean = layer[0] / layer[2]  # the probe pools heads by count; so does the recorder's per-head mean here,
        # since every head of a layer sees the same pairs
        assert float(layer[2]) % r.num_heads == 0
        torch.testing.assert_close(mean, r.qk_logit_mean.mean(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(layer[1] / layer[2], r.qk_logit_abs_mean.mean(), rtol=1e-6, atol=1e-6)
    full = 2 * 14 * 15 // 2 * model.config.num_attention_heads  # causal pairs of two unmasked rows
    assert all(float(layer[2]) < full for layer in sums)  # windows, documents or padding hid pairs


def test_a_users_key_mask_keeps_its_meaning_under_compile():
    """A user's own (B, 1, 1, S) boolean mask means "every unmasked key" (bidirectional) to transformers; the
    converted model reads it so also in a traced graph, where it once fell back to causal + padding."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 9), generator=gen)
    keys = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    keys[1, ..., :2] = False
    base = tiny("llama")
    conv = tiny("llama", "softmax")
    with torch.no_grad():
        want = base(ids, attention_mask=keys).logits
        compiled = torch.compile(conv, backend="eager", fullgraph=True)
        got = compiled(ids, attention_mask=keys).logits
        causal = base(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert float((want - causal).abs().max()) > 1e-2  # the bidirectional reading differs from the causal one


def _square(x):
    """An elementwise score function with no closed form any backend knows: x + x^2 / 8."""
    return x + x * x / 8


@pytest.mark.parametrize("fn", [_square, Softcap(2.0)], ids=["score_fn", "softcap"])
def test_a_score_function_is_applied_by_the_backends_that_declare_it(fn):
    """Score(fn=...) on the automatic choice equals the float64 reference in outputs and gradients (q, k, v and
    the per-query scale); a backend that cannot apply it, forced, refuses the call by name."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 7, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    q_scale = (torch.rand(2, 4, 7, generator=gen, dtype=torch.float64) + 0.5).requires_grad_(True)
    score = Score(8 ** -0.5, q_scale, fn)
    call = AttentionCall.of(q, k, v, is_causal=True, score=score)
    out = attend_call(call)
    ref, _ = softmax_attention_reference(q, k, v, is_causal=True, score=score)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, q_scale))
    want = torch.autograd.grad(ref.square().sum(), (q, k, v, q_scale))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)
    for name in ("sdpa", "cpu_flash"):
        with use_backend(name), pytest.raises(ValueError, match="score function|soft-capping"):
            attend_call(call)
