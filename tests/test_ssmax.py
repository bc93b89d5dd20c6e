"""Scalable softmax (variants/ssmax.py), the proof of the score hook: its fast path on every CPU backend equals its
definition written out in float64 (logits times s log N + b, N the keys each query sees), gradients included, under
causal, window, packed-document and padding masks; a converted model runs it; compare and the report take it from
the registry like any variant."""
from __future__ import annotations

import pytest
import torch

from test_train_helpers import tiny  # noqa: F401  (fixture: the tiny training config)

from affine_attention.ops.backends import use_backend
from affine_attention.ops.reference import visible_mask
from affine_attention.variants import AttentionShape, build_variant

SHAPE = AttentionShape(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8)
B, T = 2, 10
MASKS = {
    "causal": {"is_causal": True},
    "window_documents": {"is_causal": True, "window": 3,
                         "document_ids": torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])},
    "padding": {"is_causal": True, "attn_mask": torch.tensor([[True] * T, [False] * 3 + [True] * 7])[:, None, None]},
}


def _definition(m, q, k, v, mask):
    """SSMax written out: softmax over visible keys of q.k / sqrt(D) * (s_h log N_i + b_h); rows that see nothing: 0."""
    vis = visible_mask(mask.get("attn_mask"), mask["is_causal"], T, T, "cpu", window=mask.get("window"),
                       document_ids=mask.get("document_ids"))
    n = vis.sum(-1).double().clamp(min=1)  # (B|1, 1, T)
    mult = m.s[None, :, None] * torch.log(n) + m.b[None, :, None]  # (B|1, Hq, T)
    G = SHAPE.num_heads // SHAPE.num_kv_heads
    logits = (q @ k.repeat_interleave(G, 1).transpose(-1, -2)) / SHAPE.head_dim ** 0.5 * mult[..., None]
    w = torch.softmax(logits.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0)
    return w @ v.repeat_interleave(G, 1)


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 4, T, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, 2, T, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    x = torch.randn(B, T, 32, generator=gen, dtype=torch.float64)
    return q, k, v, x


@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
@pytest.mark.parametrize("backend", ["exact", "cpu_flash"])
def test_ssmax_equals_its_definition_in_outputs_and_gradients(mask, backend):
    m = build_variant("ssmax", SHAPE).double()
    with torch.no_grad():
        m.s.uniform_(0.2, 0.6)
        m.b.uniform_(-0.3, 0.3)
    q, k, v, x = _inputs()
    with use_backend(backend):
        out = m(q, k, v, x, **mask)
    want = _definition(m, q, k, v, mask)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m.reference(q, k, v, x, **mask)[0], want, rtol=1e-10, atol=1e-12)
    params = (q, k, v, m.s, m.b)
    got = torch.autograd.grad(out.square().sum(), params)
    ref = torch.autograd.grad(want.square().sum(), params)
    for name, g, r in zip(("q", "k", "v", "s", "b"), got, ref):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10, msg=lambda e, name=name: f"d{name}: {e}")
    assert float(got[3].abs().max()) > 0  # s learns


def test_ssmax_is_not_softmax_and_retrofits_to_it():
    """Its logits depend on N (not a softmax with another scale); its function-preserving state (s = 0, b = 1)
    gives softmax's output exactly."""
    q, k, v, x = _inputs(1)
    softmax = build_variant("softmax", SHAPE).double()
    m = build_variant("ssmax", SHAPE).double()
    base = softmax(q, k, v, x, is_causal=True)
    assert float((m(q, k, v, x, is_causal=True) - base).detach().abs().max()) > 1e-3
    assert m.retrofit() == 1.0
    torch.testing.assert_close(m(q, k, v, x, is_causal=True), base, rtol=1e-12, atol=1e-12)


def test_a_converted_model_runs_ssmax_on_packed_rows():
    """Through the transformers seam: packed rows equal the per-document forwards (N counts each document's keys)."""
    from test_hf_common import VOCAB
    from test_hf_common import tiny as tiny_model

    model = tiny_model("mistral", "ssmax")  # a 4-token sliding window
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (6, 3, 7)]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        packed = model(input_ids=torch.cat(docs)[None], position_ids=pos, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=d[None], use_cache=False).logits[0] for d in docs])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_ssmax_reaches_compare_and_the_report(tiny, tmp_path):
    """From the registry alone: compare trains it beside softmax, the report and its figures show it."""
    pytest.importorskip("matplotlib")
    from affine_attention.analysis.report import write_report
    from affine_attention.train.compare import compare
    from affine_attention.train.config_load import load_config

    cfg = load_config("tiny", tiny + ["train.steps=2", "train.eval_every=2", "compare.variants=['softmax', 'ssmax']"])
    root = tmp_path / "cmp"
    summary = compare(cfg, root, seeds=1, log=lambda m: None)
    assert summary["variants"]["ssmax"]["param_overhead"] == 2 * 2 * 2  # s and b, per head (2) and layer (2)
    paths = write_report(root, sequences=1)
    md = paths["md"].read_text()
    assert "| ssmax | baseline | 8 |" in md and "ssmax +" in md  # its row, and paired against softmax
    from test_architecture import _has_colour

    assert _has_colour(paths["figures"] / "loss.png", "#332288")  # drawn in its own colour
