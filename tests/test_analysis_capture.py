"""AttentionRecorder: hook-captured statistics equal a hand computation and do not depend on the chunk size."""
import math

import pytest
import torch
from torch import nn

from affine_attention.analysis import mass_metrics, pattern_metrics, scale_metrics
from affine_attention.analysis.capture import AttentionRecorder, find_variant_modules, utilisation
from affine_attention.variants import AttentionShape, build_variant

HID, HQ, HKV, D = 16, 4, 2, 4


class ToyAttention(nn.Module):
    """Projections + an attention variant called exactly as the hf seam calls it (keywords after q, k, v, x)."""

    def __init__(self, variant: str, **options):
        super().__init__()
        self.q_proj = nn.Linear(HID, HQ * D, bias=False)
        self.k_proj = nn.Linear(HID, HKV * D, bias=False)
        self.v_proj = nn.Linear(HID, HKV * D, bias=False)
        self.attn_variant = build_variant(variant, AttentionShape(HID, HQ, HKV, D), **options)

    def forward(self, x, attn_mask=None, is_causal=True, token_mask=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, HQ, D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, HKV, D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, HKV, D).transpose(1, 2)
        out = self.attn_variant(q, k, v, x, attn_mask=attn_mask, is_causal=is_causal, scale=None,
                                token_mask=token_mask, v_mean=None)
        return x + out.transpose(1, 2).reshape(B, T, HQ * D)


class ToyModel(nn.Module):
    def __init__(self, variant="softmax", layers=2, **options):
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"self_attn": ToyAttention(variant, **options)})
                                     for _ in range(layers)])

    def forward(self, x, attention_mask=None):
        km = attention_mask.bool()[:, None, None, :] if attention_mask is not None else None
        for layer in self.layers:
            x = layer["self_attn"](x, attn_mask=km)
        return x


def _randomise(model):
    """Non-trivial alpha, sinks, gates and alpha_ma, so every variant's extra pieces matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "alpha_proj" in name or "gate_proj" in name:
                p.normal_(0, 2.0)
            if name.endswith("sinks"):
                p.normal_(0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith("alpha_ma"):
                b.uniform_(0.2, 0.9)
    return model.double().eval()


def _run(model, x, mask=None, **kw):
    with AttentionRecorder(model, **kw) as rec:
        model(x, attention_mask=mask)
    return rec.results()


@torch.no_grad()
def test_softmax_matches_hand_computation():
    model = _randomise(ToyModel("softmax", layers=1))
    B, T = 2, 7
    x = torch.randn(B, T, HID, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 5:] = False  # right padding: the last two queries of sequence 1 are not real
    (rec,) = _run(model, x, mask, chunk=3, map_size=5)
    att = model.layers[0]["self_attn"]
    q = att.q_proj(x).view(B, T, HQ, D).transpose(1, 2)
    k = att.k_proj(x).view(B, T, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(D)
    vis = torch.tril(torch.ones(T, T, dtype=torch.bool)) & mask[:, None, None, :]
    p = torch.softmax(logits.masked_fill(~vis, -math.inf), -1)
    for h in range(HQ):
        first, ent, tot, qk, n_l = [], [], [], [], 0
        for b in range(B):
            for i in range(T):
                if not mask[b, i]:
                    continue
                row = p[b, h, i, : i + 1]
                first.append(row[0])
                ent.append(-(row * row.log()).sum())
                tot.append(row[1:].sum())
                qk.append(logits[b, h, i, : i + 1].sum())
                n_l += i + 1
        assert rec.stats["first_token_mass"][h] == pytest.approx(float(sum(first) / len(first)), abs=1e-12)
        assert rec.stats["entropy"][h] == pytest.approx(float(sum(ent) / len(ent)), abs=1e-12)
        assert rec.stats["mean_total_mass"][h] == pytest.approx(float(sum(tot) / len(tot)), abs=1e-12)
        assert rec.qk_logit_mean[h] == pytest.approx(float(sum(qk) / n_l), abs=1e-12)
        assert int(rec.stats["n_queries"][h]) == int(mask.sum())
    # attention map: rows are positions, averaged over heads and the sequences whose query is real
    want = torch.stack([p[b, :, :5, :5].mean(0) for b in range(B)]).mean(0)
    torch.testing.assert_close(rec.attention_map, want, atol=1e-12, rtol=0)
    assert rec.total_mass_values.numel() == int(mask.sum()) * HQ
    assert rec.alpha is None and rec.sink_mass is None and rec.variant == "softmax"


def _close(a, b):
    assert a.index == b.index and a.name == b.name
    for key, v in a.stats.items():
        torch.testing.assert_close(v, b.stats[key], atol=1e-10, rtol=1e-10, equal_nan=True, msg=key)
    for key in ("attention_map", "qk_logit_mean", "qk_logit_abs_mean", "sink_mass"):
        va, vb = getattr(a, key), getattr(b, key)
        assert (va is None) == (vb is None)
        if va is not None:
            torch.testing.assert_close(va, vb, atol=1e-10, rtol=1e-10, equal_nan=True, msg=key)
    if a.alpha is not None:
        torch.testing.assert_close(a.alpha["mean"], b.alpha["mean"])
        torch.testing.assert_close(torch.sort(a.alpha["values"])[0], torch.sort(b.alpha["values"])[0])
    torch.testing.assert_close(torch.sort(a.total_mass_values)[0], torch.sort(b.total_mass_values)[0])


@pytest.mark.parametrize("variant", ["softmax", "sink", "affine", "gated", "affine_gated"])
def test_chunked_equals_one_shot(variant):
    model = _randomise(ToyModel(variant))
    x = torch.randn(3, 11, HID, dtype=torch.float64)
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[2, 8:] = False
    one = _run(model, x, mask, chunk=1000)
    for chunk in (1, 4):
        for a, b in zip(one, _run(model, x, mask, chunk=chunk)):
            _close(a, b)
    extra = {"sink": "sink_mass", "affine": "alpha", "affine_gated": "alpha"}.get(variant)
    if extra:
        assert getattr(one[0], extra) is not None


@torch.no_grad()
def test_one_shot_equals_metrics_functions():
    """With one block the recorder is exactly the one-shot metrics applied to the reference weights."""
    model = _randomise(ToyModel("sink", layers=1))
    x = torch.randn(2, 6, HID, dtype=torch.float64)
    (rec,) = _run(model, x, chunk=64)
    att = model.layers[0]["self_attn"]
    B, T = 2, 6
    q = att.q_proj(x).view(B, T, HQ, D).transpose(1, 2)
    k = att.k_proj(x).view(B, T, HKV, D).transpose(1, 2)
    v = att.v_proj(x).view(B, T, HKV, D).transpose(1, 2)
    _, w, ex = att.attn_variant.reference(q, k, v, x, is_causal=True)
    vis = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None]
    torch.testing.assert_close(rec.stats["entropy"],
                               pattern_metrics.attention_entropy(w, vis, sink_mass=ex["sink_mass"]))
    torch.testing.assert_close(rec.stats["first_token_mass"], mass_metrics.first_token_mass(w, vis))
    torch.testing.assert_close(rec.sink_mass, ex["sink_mass"].mean((0, 2)))
    from affine_attention.ops import attention_logits

    mean, mean_abs = scale_metrics.mean_qk_logit(attention_logits(q, k, enable_gqa=True), vis)
    assert float(rec.qk_logit_mean.mean()) == pytest.approx(mean)  # every head has the same visible count
    assert float(rec.qk_logit_abs_mean.mean()) == pytest.approx(mean_abs)


def test_queries_after_a_cache_and_dense_masks():
    """T < S (bottom-right causal) and a dense mask: chunking stays exact."""
    var = _randomise(ToyModel("affine", layers=1)).layers[0]["self_attn"].attn_variant
    holder = nn.ModuleDict({"attn_variant": var})
    q = torch.randn(2, HQ, 5, D, dtype=torch.float64)
    k, v = torch.randn(2, 2, HKV, 9, D, dtype=torch.float64)
    x = torch.randn(2, 5, HID, dtype=torch.float64)
    dense = torch.rand(2, 1, 5, 9) > 0.3
    dense[..., 0] = True
    for kw in ({"is_causal": True}, {"is_causal": False, "attn_mask": dense},
               {"is_causal": True, "attn_mask": dense[:, :, :1]}):
        res = []
        for chunk in (2, 100):
            with AttentionRecorder(holder, chunk=chunk) as rec:
                var(q, k, v, x, **kw)
            res.append(rec.results()[0])
        _close(*res)


def test_recorder_leaves_outputs_alone_and_selects_layers():
    model = _randomise(ToyModel("affine", layers=3))
    x = torch.randn(1, 5, HID, dtype=torch.float64)
    ref = model(x)
    with AttentionRecorder(model, layers=[2], chunk=2) as rec:
        out = model(x)
    torch.testing.assert_close(out, ref)
    (only,) = rec.results()
    assert only.index == 2 and only.name == "layers.2.self_attn.attn_variant"
    assert len(model._forward_hooks) == 0 and len(model.layers[2]["self_attn"].attn_variant._forward_hooks) == 0
    assert utilisation(_run(model, x)).shape == (3, HQ)
    assert [i for i, _, _ in find_variant_modules(model)] == [0, 1, 2]


def test_clear_errors():
    with pytest.raises(ValueError, match="convert it first"):
        AttentionRecorder(nn.Linear(2, 2))
    model = ToyModel(layers=1)
    with pytest.raises(ValueError, match="chunk"):
        AttentionRecorder(model, chunk=0)
    with pytest.raises(ValueError, match="layers"):
        AttentionRecorder(model, layers=[5])
    with pytest.raises(RuntimeError, match="recorded nothing"):
        AttentionRecorder(model).results()


def test_padded_batch_of_a_converted_hf_model_equals_unpadded_runs():
    """Right padding in a real converted Llama: padded queries enter no statistic (mask from the model's input)."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    import affine_attention
    from affine_attention.analysis.analyze import record

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=128))
    affine_attention.convert(model, "sink")
    model = _randomise(model)
    ids = torch.randint(0, 128, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    padded = record(model, ids, attention_mask=mask, chunk=5, batch_size=2)
    a = record(model, ids[:1], chunk=5)
    b = record(model, ids[1:, :8], chunk=5)
    for p, ra, rb in zip(padded, a, b):
        n_a, n_b = 12, 8
        for key in ("first_token_mass", "entropy", "mean_total_mass"):
            want = (ra.stats[key] * n_a + rb.stats[key] * n_b) / (n_a + n_b)
            torch.testing.assert_close(p.stats[key], want, atol=1e-9, rtol=1e-9, msg=key)
        assert int(p.stats["n_queries"][0]) == 20
        torch.testing.assert_close(p.sink_mass, (ra.sink_mass * n_a + rb.sink_mass * n_b) / (n_a + n_b))
