"""torch.compile(model, fullgraph=True) of converted models: a training step (forward + backward, with and without
padding) and a cached decoding step with a dynamic and with a static cache, equal to eager (<= 1e-5, fp32).
Default suite: backend "aot_eager" (traces dynamo + AOTAutograd, no C++ build) on a covering set of family x variant
cells; the slow suite adds "inductor"; `-m exhaustive` runs every cell."""
from __future__ import annotations

import copy

import pytest
import torch
from test_hf_common import CACHE, left_padded, perturb, tiny
from transformers import DynamicCache, StaticCache

import affine_attention
from affine_attention.hf.families import refusal
from affine_attention.hf.presets import PRESETS
from affine_attention.variants import variant_names

TOL = 1e-5
# tiny-mistral: sliding window 4, shorter than the sequences here; gemma2 caps its logits (the exact kernel traced),
# gpt_oss hands its own sinks to the variants.
FAMILIES = ["llama", "qwen2", "mistral", "gemma2", "gpt_oss"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(family, variant):
    # one layer; a family with layer types keeps its first (sliding-window) one
    types = PRESETS[f"tiny-{family}"].get("layer_types")
    extra = {"layer_types": types[:1]} if types else {}
    if family == "gpt_oss":
        # its MoE MLP does not trace with fullgraph on torch 2.11 in transformers' default experts (a data-dependent
        # guard in the grouped-matmul fallback's backward) nor the eager ones (a loop over the experts hit): the
        # batched experts keep the test on the attention it tests
        extra["experts_implementation"] = "batched_mm"
    m = tiny(family, variant, num_hidden_layers=1, **extra)
    perturb(m)
    return m


def _batch(padded: bool):
    return left_padded(T=8, pads=(0, 3, 1) if padded else (0, 0, 0))


def check_training_step(family, variant, padded, backend):
    eager = _model(family, variant).train()
    compiled_model = copy.deepcopy(eager)
    ids, mask, pos = _batch(padded)
    kw = dict(attention_mask=mask, position_ids=pos, labels=ids)
    loss = torch.compile(compiled_model, backend=backend, fullgraph=True)(ids, **kw).loss
    loss.backward()
    ref = eager(ids, **kw).loss
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=0, atol=TOL)
    grads = dict(eager.named_parameters())
    for n, p in compiled_model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=0, atol=TOL, msg=n)
    buffers = dict(eager.named_buffers())
    for n, b in compiled_model.named_buffers():  # alpha_acc: the statistic accumulated exactly once, like eager
        if n.endswith("alpha_acc"):  # (per-head sums of alpha in units of 2**-32, token count): counts exact
            assert b[-1] == buffers[n][-1] > 0, n
            torch.testing.assert_close(b[:-1] / b[-1] / 2.0 ** 32, buffers[n][:-1] / b[-1] / 2.0 ** 32,
                                       rtol=0, atol=TOL, msg=n)  # inductor's alpha may differ in the last ulp
    for m in (eager, compiled_model):
        affine_attention.step_running_stats(m)
    for n, b in compiled_model.named_buffers():
        torch.testing.assert_close(b, buffers[n], rtol=0, atol=TOL, msg=n)


def _make_cache(kind, model):
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    return StaticCache(config=model.config, max_cache_len=16)


def check_decoding_step(family, variant, kind, backend):
    """Prefill eagerly, then two compiled single-token steps (the second reuses the running state the first left
    on the cache), against the same steps in eager on a twin cache."""
    model = _model(family, variant).eval()
    ids, mask, pos = _batch(True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    caches = {"eager": _make_cache(kind, model), "compiled": _make_cache(kind, model)}
    with torch.no_grad():
        for cache in caches.values():
            model(ids, attention_mask=mask, position_ids=pos, **{CACHE: cache}, use_cache=True)
        for t in range(2):
            tok = torch.full((3, 1), 5 + t)
            m = torch.cat([mask, torch.ones(3, t + 1, dtype=mask.dtype)], 1)
            p = pos[:, -1:] + 1 + t
            kw = dict(attention_mask=m, position_ids=p, use_cache=True)
            ref = model(tok, **{CACHE: caches["eager"]}, **kw).logits
            got = compiled(tok, **{CACHE: caches["compiled"]}, **kw).logits
            torch.testing.assert_close(got, ref, rtol=0, atol=TOL)


def test_compiled_decoding_rebuilds_the_running_sum_after_cache_operations():
    """The trust check (`values is` the summed tensor) is an identity test inside the graph: after a beam reorder
    (same shapes) or a crop between compiled steps, the next compiled step must rebuild the sum, like eager."""
    model = _model("llama", "affine").eval()
    ids, mask, pos = _batch(False)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    caches = {"eager": DynamicCache(config=model.config), "compiled": DynamicCache(config=model.config)}
    with torch.no_grad():
        for cache in caches.values():
            model(ids, attention_mask=mask, position_ids=pos, **{CACHE: cache}, use_cache=True)
        for t, op in enumerate([None, "reorder", None, "crop", None]):
            for cache in caches.values():
                if op == "reorder":
                    cache.reorder_cache(torch.tensor([2, 0, 1]))
                elif op == "crop":
                    cache.crop(-2)
            length = caches["eager"].get_seq_length()
            kw = dict(attention_mask=torch.ones(3, length + 1, dtype=mask.dtype),
                      position_ids=torch.full((3, 1), length), use_cache=True)
            tok = torch.tensor([[7 + t], [9], [11]])
            ref = model(tok, **{CACHE: caches["eager"]}, **kw).logits
            got = compiled(tok, **{CACHE: caches["compiled"]}, **kw).logits
            torch.testing.assert_close(got, ref, rtol=0, atol=TOL)
    layer = caches["compiled"].layers[0]
    assert layer._affine_vsrc is layer.values  # the compiled steps kept the running state on the cache layer


ALL = [(f, v) for f in FAMILIES for v in variant_names() if not refusal(f, v)]
# Default suite (aot_eager): one compiled model per family kind (plain, biases, window, softcap, own sinks) and per
# variant kind (plain, lse, value mean, gate; tests/covering.variant_kinds), with scaled_softmax's constant float gate
# and the window with a sink besides. test_every_family_and_variant_kind_is_compiled checks that coverage. The rest
# of the cross is marked `exhaustive`; inductor cells are `slow`.
TRAIN = [("llama", "softmax"), ("llama", "sink"), ("llama", "affine_gated"), ("llama", "scaled_softmax"),
         ("qwen2", "affine"), ("mistral", "sink"), ("mistral", "affine_gated"), ("gemma2", "affine_gated"),
         ("gpt_oss", "sink"), ("gpt_oss", "gated")]
DECODE = [("llama", "softmax"), ("qwen2", "affine"), ("mistral", "affine_gated"), ("gemma2", "affine"),
          ("gpt_oss", "sink")]


def _ids(cases):
    return [f"{f}-{v}" for f, v in cases]


def _exhaustive_rest(cases):
    return [pytest.param(f, v, marks=pytest.mark.exhaustive) for f, v in ALL if (f, v) not in cases]


def test_every_family_and_variant_kind_is_compiled():
    from covering import variant_kinds

    kinds = set().union(*(variant_kinds(v) for v in variant_names()))
    for cases in (TRAIN, DECODE):
        assert {f for f, _ in cases} == set(FAMILIES)
        assert set().union(*(variant_kinds(v) for _, v in cases)) == kinds


@pytest.mark.parametrize("family, variant", TRAIN + _exhaustive_rest(TRAIN),
                         ids=_ids(TRAIN) + _ids([c for c in ALL if c not in TRAIN]))
def test_compiled_training_step_equals_eager(family, variant):
    for padded in (False, True):
        check_training_step(family, variant, padded, "aot_eager")


@pytest.mark.parametrize("family, variant", DECODE + _exhaustive_rest(DECODE),
                         ids=_ids(DECODE) + _ids([c for c in ALL if c not in DECODE]))
def test_compiled_decoding_step_equals_eager(family, variant):
    for kind in ("dynamic", "static"):
        check_decoding_step(family, variant, kind, "aot_eager")


# Inductor: every kind of epilogue on Llama, and on the other families the variants whose path their layout changes
# (the value mean and gate under Mistral's sliding window, the sink there, the value mean with Qwen2's biases);
# aot_eager above covers every family and variant kind (every pair with -m exhaustive).
INDUCTOR = [("llama", v) for v in ("softmax", "sink", "gated", "affine", "affine_gated")] + [
    ("mistral", "sink"), ("mistral", "affine_gated"), ("qwen2", "affine")]


@pytest.mark.slow
@pytest.mark.parametrize("family, variant", INDUCTOR, ids=_ids(INDUCTOR))
def test_inductor_training_and_decoding(family, variant):
    for padded in (False, True):
        check_training_step(family, variant, padded, "inductor")
    for kind in ("dynamic", "static"):
        check_decoding_step(family, variant, kind, "inductor")
