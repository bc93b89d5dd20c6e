"""Cached decoding equals a full forward: manual stepping, greedy generate, beam search, cache crops; and the affine
running value sum is really used (and rebuilt after the cache changes under it)."""
from __future__ import annotations

import pytest
import torch
from test_hf_common import CACHE, FAMILIES, VOCAB, left_padded, perturb, richest, tiny
from transformers import DynamicCache

import affine_attention
import affine_attention.hf.cache as value_cache
from affine_attention.variants import variant_names

TOL = 1e-4


def _stepped_logits(model, ids, mask, pos, prefill: int):
    """Prefill `prefill` tokens, then feed one token at a time; logits (B, T, V)."""
    cache = DynamicCache(config=model.config)
    out = model(ids[:, :prefill], attention_mask=mask[:, :prefill], position_ids=pos[:, :prefill], **{CACHE: cache},
                use_cache=True)
    logits = [out.logits]
    for t in range(prefill, ids.shape[1]):
        out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1], **{CACHE: cache},
                    use_cache=True)
        logits.append(out.logits)
    return torch.cat(logits, 1)


def _check_stepping_and_generate(model, T=12, prefill=6):
    ids, mask, pos = left_padded(T=T)
    real = mask.bool()
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=pos).logits
        stepped = _stepped_logits(model, ids, mask, pos, prefill)
        assert (stepped - full)[real].abs().max() <= TOL
        gen = model.generate(ids[:, :prefill], attention_mask=mask[:, :prefill], max_new_tokens=T - prefill,
                             do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        seq = gen.sequences
        gmask = torch.cat([mask[:, :prefill], torch.ones_like(mask[:, prefill:])], 1)
        gpos = (gmask.cumsum(-1) - 1).clamp(min=0)
        refull = model(seq, attention_mask=gmask, position_ids=gpos).logits
    scores = torch.stack(gen.scores, 1)  # (B, new, V): logits of each generated step
    assert (scores - refull[:, prefill - 1:-1]).abs().max() <= TOL
    assert torch.equal(seq[:, prefill:], refull[:, prefill - 1:-1].argmax(-1))


@pytest.mark.parametrize("variant", variant_names())
def test_cached_decoding_matches_full_forward(variant):
    model = tiny("llama", variant)
    perturb(model)
    _check_stepping_and_generate(model)


def test_cached_decoding_keeps_the_running_sum_the_variant_declares(monkeypatch):
    """The decode cache divides its running value sum as the variant's `value_mean_norm` says (here affine's
    bias_norm="full" ablation: by every key), not by an option it would have to know the name of: stepping equals
    the op averaging the cache itself."""
    model = tiny("llama")
    affine_attention.convert(model, "affine", bias_norm="full")
    assert {layer.self_attn.attn_variant.value_mean_norm for layer in model.model.layers} == {"full"}
    perturb(model)
    ids, mask, pos = left_padded(T=10)
    with torch.no_grad():
        summed = _stepped_logits(model, ids, mask, pos, prefill=6)
        monkeypatch.setattr(value_cache, "value_mean", lambda *args: None)  # the op's own mean of the cache
        own = _stepped_logits(model, ids, mask, pos, prefill=6)
    assert (summed - own)[mask.bool()].abs().max() <= 1e-5


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_cached_decoding_other_families(family):
    model = tiny(family, richest(family))  # mistral and others: 12 tokens through a 4-token sliding-window cache
    perturb(model)
    _check_stepping_and_generate(model)


def _decode_kinds(monkeypatch):
    """Count how each affine decoding step got its mean of V: incremental, rebuilt, or left to the op."""
    kinds, rebuilt = [], []
    real_mean, real_sum = value_cache.value_mean, value_cache._sum_cached

    def spy_sum(*args):
        rebuilt.append(True)
        return real_sum(*args)

    def spy_mean(*args):
        rebuilt.clear()
        out = real_mean(*args)
        kinds.append("op" if out is None else ("rebuilt" if rebuilt else "incremental"))
        return out

    monkeypatch.setattr(value_cache, "_sum_cached", spy_sum)
    monkeypatch.setattr(value_cache, "value_mean", spy_mean)
    return kinds


def test_running_sum_is_used_and_rebuilt_after_crop(monkeypatch):
    model = tiny("llama", "affine")
    perturb(model)
    kinds = _decode_kinds(monkeypatch)
    ids, mask, pos = left_padded(T=12)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :6], attention_mask=mask[:, :6], position_ids=pos[:, :6], **{CACHE: cache})
        for t in range(6, 9):
            model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1], **{CACHE: cache})
        assert kinds == ["rebuilt"] * 2 + ["incremental"] * 6  # 2 layers: prefill, then 3 O(D) steps
        # Drop the last two tokens and continue with different ones: the stale sums must not be used.
        cache.crop(-2)
        other = torch.randint(0, VOCAB, (3, 3))
        new_ids = torch.cat([ids[:, :7], other], 1)
        last = []
        for t in range(7, 10):
            out = model(new_ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1],
                        **{CACHE: cache})
            last.append(out.logits)
        full = model(new_ids, attention_mask=mask[:, :10], position_ids=pos[:, :10]).logits
    assert kinds[8:14] == ["rebuilt"] * 2 + ["incremental"] * 4
    assert (torch.cat(last, 1) - full[:, 7:])[mask[:, 7:10].bool()].abs().max() <= TOL


def test_key_mask_is_compared_once_per_step_not_per_layer(monkeypatch):
    """Every layer sees the same padding: one comparison of the cached positions' mask per model forward (on a GPU
    each is a host sync), not one per layer."""
    model = tiny("llama", "affine")
    perturb(model)
    calls = []
    real_equal = value_cache.torch.equal

    def counting_equal(a, b):
        calls.append(1)
        return real_equal(a, b)

    monkeypatch.setattr(value_cache.torch, "equal", counting_equal)
    ids, mask, pos = left_padded(T=10)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :6], attention_mask=mask[:, :6], position_ids=pos[:, :6], **{CACHE: cache})
        calls.clear()
        for t in range(6, 10):
            model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1], **{CACHE: cache})
    assert model.config.num_hidden_layers > 1 and len(calls) == 4  # 4 steps


@pytest.mark.parametrize("variant", ["affine", "sink"])
def test_beam_search_matches_uncached(variant):
    """Beam search reorders the cache every step: the running sum is rebuilt, never stale."""
    model = tiny("llama", variant)
    perturb(model)
    ids, mask, _ = left_padded(T=6)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False, pad_token_id=0,
                  output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        cached = model.generate(ids, **kwargs)
        uncached = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    assert torch.allclose(cached.sequences_scores, uncached.sequences_scores, atol=TOL)


def test_changed_key_mask_is_not_trusted(monkeypatch):
    """A key mask that changes between calls (a cached token masked after the fact) is detected: the step equals
    the op averaging the cache itself rather than a stale running sum."""
    model = tiny("llama", "affine")
    perturb(model)
    ids, mask, pos = left_padded(T=9, pads=(0, 0, 0))
    changed = mask.clone()
    changed[:, 2] = 0

    def last_step():
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(ids[:, :8], attention_mask=mask[:, :8], position_ids=pos[:, :8], **{CACHE: cache})
            return model(ids[:, 8:], attention_mask=changed, position_ids=pos[:, 8:], **{CACHE: cache}).logits

    kinds = _decode_kinds(monkeypatch)
    out = last_step()
    assert kinds[2:] == ["rebuilt"] * 2
    monkeypatch.setattr(value_cache, "value_mean", lambda *args: None)  # the op's own masked mean of the cache
    assert (out - last_step()).abs().max() <= 1e-6


def test_qwen2_with_full_and_sliding_layers():
    model = tiny("qwen2", "affine", use_sliding_window=True, sliding_window=3, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    perturb(model)
    _check_stepping_and_generate(model)


def test_static_cache_matches_dynamic_cache():
    """Static caches give non-aligned masks: the dense path, averaged by the op, stays exact."""
    model = tiny("llama", "affine")
    perturb(model)
    ids, mask, _ = left_padded(T=6)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        dynamic = model.generate(ids, **kwargs)
        static = model.generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(dynamic.sequences, static.sequences)
    assert (torch.stack(dynamic.scores) - torch.stack(static.scores)).abs().max() <= TOL


@pytest.mark.parametrize("cache_implementation", ["static", "sliding_window"])
@pytest.mark.parametrize("family, variant", [("mistral", "softmax"), ("mistral", "affine"), ("gemma3", "affine")])
def test_static_and_sliding_caches_on_a_padded_batch_with_windows_match_the_dynamic_cache(family, variant,
                                                                                          cache_implementation):
    """generate builds the masks of a compilable cache itself and hands them back to the model, whose own mask code
    reads them as tensors: the seam's key padding is one (a tensor type of its own), so a padded batch on a
    windowed family decodes as with the dynamic cache, the prompt (6) and the decode past the window (4)."""
    model = tiny(family, variant)
    perturb(model)
    assert model.config.sliding_window == 4
    ids, mask, _ = left_padded(T=6)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        dynamic = model.generate(ids, **kwargs)
        static = model.generate(ids, cache_implementation=cache_implementation, **kwargs)
    assert torch.equal(dynamic.sequences, static.sequences)
    assert (torch.stack(dynamic.scores) - torch.stack(static.scores)).abs().max() <= TOL
