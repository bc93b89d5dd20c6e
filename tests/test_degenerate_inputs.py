"""Degenerate and loosely typed inputs at the op and layer seams: empty inputs give empty outputs (as SDPA does) and
never take the process down, a non-finite key or value reaches as nan every query that may see it (masked or not,
any dtype), and everything else is a ValueError naming the argument."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from affine_attention.ops import affine_scaled_attention, softmax_attention
from affine_attention.variants import AttentionShape, build_variant, variant_names

# Run in a child process: a kernel that divides by zero on an empty tensor kills its process (SIGFPE), which must
# fail this test, not the whole test session.
EMPTY = r"""
import json, torch
from affine_attention.ops import affine_scaled_attention, off_by_one_attention, sink_attention, softmax_attention
OPS = {
    "softmax": lambda q, k, v, **kw: softmax_attention(q, k, v, **kw),
    "off_by_one": lambda q, k, v, **kw: off_by_one_attention(q, k, v, **kw),
    "sink": lambda q, k, v, **kw: sink_attention(q, k, v, torch.zeros(q.shape[1], requires_grad=True), **kw),
    "affine": lambda q, k, v, **kw: affine_scaled_attention(
        q, k, v, torch.rand(q.shape[0], q.shape[1], q.shape[2], requires_grad=True), torch.rand(q.shape[1]), **kw),
}
S, D = 5, 4
def case(B, H, T, kind):
    pad = torch.ones(B, 1, 1, S, dtype=torch.bool)
    if B:
        pad[0, ..., 0] = False
    return {"pad": dict(attn_mask=pad), "causal": dict(is_causal=True),
            "window": dict(is_causal=True, window=2),
            "docs": dict(is_causal=True, document_ids=torch.zeros(B, S, dtype=torch.long))}[kind]
out = {}
for name, op in OPS.items():
    for B, H, T in ((2, 2, 0), (0, 2, 3), (2, 0, 3)):
        for kind in ("pad", "causal", "window", "docs"):
            q = torch.randn(B, H, T, D, requires_grad=True)
            k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(2))
            y = op(q, k, v, **case(B, H, T, kind))
            y.sum().backward()
            out[f"{name} B={B} H={H} T={T} {kind}"] = [list(y.shape), [list(t.grad.shape) for t in (q, k, v)],
                                                       float(sum(t.grad.abs().sum() for t in (q, k, v)))]
print(json.dumps(out))
"""


def test_empty_inputs_give_empty_outputs_and_zero_gradients_on_every_op_and_mask():
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", EMPTY], capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, f"the process died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 4 * 3 * 4
    for label, (shape, grads, total) in results.items():
        B, H, T = (int(p.split("=")[1]) for p in label.split()[1:4])
        assert shape == [B, H, T, 4], label
        assert grads == [[B, H, T, 4], [B, H, 5, 4], [B, H, 5, 4]] and total == 0.0, label


@pytest.mark.parametrize("name", variant_names())
def test_an_empty_sequence_through_every_variant_layer(name):
    layer = build_variant(name, AttentionShape(8, 2, 2, 4))
    q, k, v, x = torch.randn(2, 2, 0, 4), torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4), torch.randn(2, 0, 8)
    assert layer(q, k, v, x, is_causal=True).shape == (2, 2, 0, 4)


@pytest.mark.parametrize("name", variant_names())
def test_layer_inputs_of_the_wrong_kind_are_value_errors(name):
    layer = build_variant(name, AttentionShape(8, 2, 2, 4))
    q, k, v, x = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4), torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="x the \\(B, T, hidden\\) attention input"):
        layer(q, k, v, None, is_causal=True)
    with pytest.raises(ValueError, match="token_mask must be a bool tensor"):
        layer(q, k, v, x, is_causal=True, token_mask=torch.ones(2, 3))  # a float mask is not read as padding
    with pytest.raises(ValueError, match="token_mask must be a bool tensor"):
        layer(q, k, v, x, is_causal=True, token_mask=torch.ones(2, 4, dtype=torch.bool))
    for training in (True, False):  # on another device it once failed in the statistics with a RuntimeError
        layer.train(training)
        with pytest.raises(ValueError, match=r"token_mask is on meta but x is on cpu; move it with "
                                             r"`token_mask.to\(x.device\)`"):
            layer(q, k, v, x, is_causal=True, token_mask=torch.ones(2, 3, dtype=torch.bool, device="meta"))
    if any(True for _ in layer.parameters()):
        with pytest.raises(ValueError, match="float64 must be used for the inputs and the module"):
            layer(q.double(), k.double(), v.double(), x.double(), is_causal=True)


@pytest.mark.parametrize("bad", ["no", 1, None])
def test_enable_gqa_must_be_a_bool(bad):
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="enable_gqa must be a bool"):
        softmax_attention(q, k, k, enable_gqa=bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("mask", ["none", "causal", "keypad"])
@pytest.mark.parametrize("path", ["eager_cpu", "accelerator"])
def test_a_non_finite_key_or_value_makes_exactly_the_queries_that_see_it_nan(monkeypatch, dtype, value, where, mask,
                                                                             path):
    """Without a mask too: a key whose logit is -inf would otherwise drop out of the softmax and leave the output
    finite, silently. path: "accelerator" takes the rule's path for devices where reading a value would sync."""
    from affine_attention.ops import nonfinite

    monkeypatch.setattr(nonfinite, "_asks", lambda t: path == "eager_cpu" and t.device.type == "cpu")
    torch.manual_seed(0)
    B, H, T, S, D = 2, 4, 4, 6, 8
    q, k, v = torch.randn(B, H, T, D, dtype=dtype), torch.randn(B, 2, S, D, dtype=dtype), torch.randn(B, 2, S, D, dtype=dtype)
    (k if where == "k" else v)[0, 1, 4] = value  # row 0, KV head 1 (query heads 2 and 3), key 4
    kw = {"none": {}, "causal": {"is_causal": True},
          "keypad": {"attn_mask": torch.tensor([True] * 5 + [False])[None, None, None].expand(B, 1, 1, S)}}[mask]
    sees = torch.zeros(B, H, T, dtype=torch.bool)
    visible = {"none": [0, 1, 2, 3], "causal": [2, 3], "keypad": [0, 1, 2, 3]}[mask]  # causal: i + S - T >= 4
    sees[0, 2:, visible] = True
    for out in (softmax_attention(q, k, v, enable_gqa=True, **kw),
                affine_scaled_attention(q, k, v, torch.rand(B, H, T), torch.rand(H), enable_gqa=True, **kw)):
        assert torch.equal(out.isnan().any(-1), sees)
        assert torch.isfinite(out[~sees]).all()


def test_a_decoding_cache_tracks_its_non_finite_heads_from_the_rows_each_step_appends():
    """hf.cache.nonfinite_heads: rebuilt from the whole cache when anything replaced it, then updated from the
    appended rows only; what it returns spares the op's own O(S * D) test and gives the same outputs."""
    from transformers import DynamicCache

    from affine_attention.hf import cache as value_cache
    from affine_attention.ops.attention import attention_with_epilogue

    cache = DynamicCache()
    fine = DynamicCache()
    for _ in range(2):  # every row finite: False, the op tests nothing
        trusted = value_cache.kv_before_update(fine, 0)
        key, value = fine.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), 0)
        assert value_cache.nonfinite_heads(fine, 0, key, value, 3, trusted) is False

    def step(k, v):
        trusted = value_cache.kv_before_update(cache, 0)
        key, value = cache.update(k, v, 0)
        T = k.shape[2]
        return trusted, value_cache.nonfinite_heads(cache, 0, key, value, T, trusted), key, value

    torch.manual_seed(0)
    k0, v0 = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    k0[0, 1, 2, 0] = float("inf")
    trusted, bad, key, value = step(k0, v0)
    assert not trusted and bad.tolist() == [[False, True]]
    q = torch.randn(1, 4, 1, 4)
    for _ in range(2):  # finite rows appended: the inf row is still there, so head 1 stays marked
        trusted, bad, key, value = step(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
        assert trusted and bad.tolist() == [[False, True]]
        hinted = attention_with_epilogue(q, key, value, is_causal=True, enable_gqa=True, kv_nonfinite=bad)
        tested = attention_with_epilogue(q, key, value, is_causal=True, enable_gqa=True)
        assert torch.equal(hinted.isnan(), tested.isnan()) and hinted[:, 2:].isnan().all()
        torch.testing.assert_close(hinted[:, :2], tested[:, :2], rtol=0, atol=0)
    key[0, 0, 0, 0] = float("nan")  # written in place: the cache cannot see it, and reads only appended rows
    trusted, bad, key, value = step(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert trusted and bad.tolist() == [[False, True]]
    cache.crop(-6)  # 8 rows -> 2: new tensors, so the record is rebuilt from the whole cache. The inf row (2) is gone;
    trusted, bad, key, value = step(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert not trusted and bad.tolist() == [[True, False]]  # the nan written in place at row 0 is found now
    with pytest.raises(ValueError, match="kv_nonfinite must be a \\(B, Hkv\\) = \\(1, 2\\) bool tensor or False"):
        attention_with_epilogue(q, key, value, enable_gqa=True, kv_nonfinite=bad.float())


@pytest.mark.parametrize("backend", [None, "cpu_flash", "exact"])
@pytest.mark.parametrize("value", [3e38, -3e38])
@pytest.mark.parametrize("where", ["k", "kv"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_finite_padded_key_near_float32s_range_changes_no_query(backend, value, where, causal):
    """Issue 43: a padded key of 3e38 made every row of its batch nan on cpu_flash (its additive -inf bias meets an
    overflowed logit: inf - inf). A padded key is hidden from every query, so nothing may depend on it."""
    from affine_attention.ops import softmax_attention_reference

    torch.manual_seed(0)
    B, H, T, D = 2, 2, 8, 16
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(3))
    keys = torch.ones(B, 1, 1, T, dtype=torch.bool)
    keys[0, ..., -2:] = False
    k[0, :, -1] = value
    if where == "kv":
        v[0, :, -1] = value
    ref = softmax_attention_reference(q, k, v, attn_mask=keys, is_causal=causal)[0]
    out = softmax_attention(q.float(), k.float(), v.float(), attn_mask=keys, is_causal=causal, backend=backend)
    rows = slice(None, -2) if causal else slice(None)  # under causal the padded queries see no key: 0 either way
    torch.testing.assert_close(out[:, :, rows].double(), ref[:, :, rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 3e38])
@pytest.mark.parametrize("where", ["q", "k", "v", "alpha"])
@pytest.mark.parametrize("mask", ["none", "causal", "keypad", "window"])
@pytest.mark.parametrize("backend", [None, "cpu_flash"])
def test_the_accelerator_path_of_the_non_finite_rule_gives_what_eager_cpu_gives(monkeypatch, value, where, mask,
                                                                                backend):
    """Where reading a value would sync (CUDA, torch.compile) the non-finite rule tests every row instead of asking
    first (ops/nonfinite.py); both paths give the same outputs and gradients, bit for bit."""
    from affine_attention.ops import nonfinite

    torch.manual_seed(0)
    B, H, T, S, D = 2, 4, 5, 7, 8
    base = dict(q=torch.randn(B, H, T, D), k=torch.randn(B, 2, S, D), v=torch.randn(B, 2, S, D),
                alpha=torch.rand(B, H, T))
    base[where][1, 1, 3] = value
    kw = {"none": {}, "causal": {"is_causal": True}, "window": {"is_causal": True, "window": 3},
          "keypad": {"attn_mask": torch.tensor([True] * 5 + [False, False])[None, None, None].expand(B, 1, 1, S)}}
    results = []
    for asks in (True, False):
        monkeypatch.setattr(nonfinite, "_asks", lambda t, asks=asks: asks and t.device.type == "cpu")
        x = {n: t.clone().requires_grad_() for n, t in base.items()}
        out = affine_scaled_attention(x["q"], x["k"], x["v"], x["alpha"], torch.rand(H, generator=torch.Generator()
                                      .manual_seed(1)), enable_gqa=True, backend=backend, **kw[mask])
        out.nan_to_num(0.0).sum().backward()
        results.append([out] + [x[n].grad for n in ("q", "k", "v", "alpha")])
    if mask == "keypad":
        # A padded key's gradient is 0 on the accelerator path (its row is zeroed before the kernel) and 0 * nan on
        # eager CPU when a query's infinite alpha makes its dO nan: both outside what any query depends on.
        for i in (2, 3):
            for r in results:
                r[i] = r[i][:, :, :5]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, equal_nan=True, atol=0, rtol=0)
