"""Precision at the edges and NaN isolation (issue 14, classes 1 and 2): every float32 gradient of the sink and
affine ops within 1e-5 (relative) of float64 at sink logits -30..30 and alpha - alpha_ma near 0, on every CPU
backend; a NaN or inf in a key or value that the mask hides reaches no output, on every op and backend."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from affine_attention.ops import affine_scaled_attention, sink_attention, softmax_attention

_spec = importlib.util.spec_from_file_location(
    "gate_precision", Path(__file__).resolve().parent.parent / "benchmarks" / "gate_precision.py")
gate_precision = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gate_precision)
BACKENDS = gate_precision.BACKENDS


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("s", gate_precision.SINK_LOGITS)
def test_sink_gradients_keep_their_digits_in_float32(backend, s):
    errors = gate_precision.sink_errors(s, backend)
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_rows_keep_their_digits(backend):
    for errors in (gate_precision.sink_errors(-17.0, backend, 1024), gate_precision.affine_errors(1e-7, backend, 1024)):
        assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("backend", BACKENDS + ("sdpa",))  # sdpa serves affine (no sink: it returns no lse)
@pytest.mark.parametrize("delta", gate_precision.ALPHA_DELTAS)
def test_affine_gradients_keep_their_digits_when_alpha_is_near_alpha_ma(backend, delta):
    errors = gate_precision.affine_errors(delta, backend)
    assert max(errors.values()) < 1e-5, errors


B, H, S, D = 2, 2, 9, 8
OPS = {
    "softmax": lambda q, k, v, **m: softmax_attention(q, k, v, **m),
    "sink": lambda q, k, v, **m: sink_attention(q, k, v, torch.full((H,), -1.0), **m),
    "affine": lambda q, k, v, **m: affine_scaled_attention(q, k, v, torch.rand(q.shape[0], H, q.shape[2]),
                                                           torch.full((H,), 0.4), **m),
}


def _poisoned(T: int, where: int, value: float, in_value: bool):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (T, S, S))
    (v if in_value else k)[:, :, where] = value
    return q, k, v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("in_value", [False, True])
def test_a_hidden_nan_or_inf_reaches_no_output(backend, op, value, in_value):
    fn = OPS[op]
    # 1. A padded key (key-padding mask, the fast path): every row is clean.
    q, k, v = _poisoned(S, where=0, value=value, in_value=in_value)
    pad = torch.ones(B, 1, 1, S, dtype=torch.bool)
    pad[..., 0] = False
    out = fn(q, k, v, attn_mask=pad, backend=backend)
    assert torch.isfinite(out).all(), f"padded key poisons {(~torch.isfinite(out)).sum()} outputs"
    # 2. Chunked prefill (T < S, causal bottom-right): queries that cannot see the poisoned last key are clean.
    T = 4
    q, k, v = _poisoned(T, where=S - 1, value=value, in_value=in_value)
    out = fn(q, k, v, is_causal=True, backend=backend)
    assert torch.isfinite(out[:, :, :-1]).all(), "a query that cannot see the poisoned key is not finite"
    # 3. A document mask hides the poisoned key from the other document's queries.
    q, k, v = _poisoned(S, where=0, value=value, in_value=in_value)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]] * B)
    out = fn(q, k, v, is_causal=True, document_ids=docs, backend=backend)
    assert torch.isfinite(out[:, :, 3:]).all(), "the other document's queries are not finite"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
def test_hidden_nan_changes_nothing_and_a_seen_one_is_never_hidden(backend, op):
    """Clean rows equal the output with the poisoned entry replaced by any finite number (outputs and gradients);
    a row that sees the entry stays nan. Dense masks and sliding windows too."""
    fn = OPS[op]
    T = S
    dense = torch.rand(B, 1, T, S, generator=torch.Generator().manual_seed(3)) > 0.3
    dense[..., 2] = False  # key 2 hidden from every query ...
    dense[:, :, -1, 2] = True  # ... but the last one
    for mask in ({"attn_mask": dense}, {"is_causal": True, "window": 3}):
        torch.manual_seed(0)  # the same alpha in both calls of the affine op
        q, k, v = _poisoned(T, where=2, value=float("nan"), in_value=True)
        q.requires_grad_(True)
        chosen = None if "attn_mask" in mask and backend == "cpu_flash" else backend  # it serves no dense mask
        out = fn(q, k, v, backend=chosen, **mask)
        torch.manual_seed(0)
        q2, k2, v2 = (t.detach().clone() for t in (q, k, v))
        v2[:, :, 2] = 123.0
        q2.requires_grad_(True)
        ref = fn(q2, k2, v2, backend=chosen, **mask)
        if "window" in mask:
            clean = torch.zeros(T, dtype=torch.bool)
            clean[:2] = True
            clean[2 + 3:] = True  # queries 0, 1 precede key 2; queries >= 5 are past its window of 3
        else:
            clean = torch.ones(T, dtype=torch.bool)
            clean[-1] = False
        assert torch.isnan(out[:, :, ~clean]).all(), "a query that sees a nan value must not get a finite output"
        # (prefix sums of the affine mean of V round differently around 0 and 123: equal to float32 precision)
        torch.testing.assert_close(out[:, :, clean], ref[:, :, clean], rtol=1e-5, atol=1e-5)
        out[:, :, clean].sum().backward()
        ref[:, :, clean].sum().backward()
        assert torch.isfinite(q.grad).all()
        torch.testing.assert_close(q.grad, q2.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", list(OPS))
def test_finite_keys_whose_sum_overflows_are_kept(op):
    """The fast check sums K and V; finite entries whose sum overflows must take the exact test, not be cleaned."""
    fn = OPS[op]
    q, k, v = _poisoned(S, where=0, value=0.0, in_value=True)
    v[:, :, :] = 1e37  # finite, and so is every mean of them; the sum of all (2.9e39) is inf in float32
    v[:, :, 3] = float("nan")  # and a nan that queries 0..2 cannot see
    torch.manual_seed(0)
    out = fn(q, k, v, is_causal=True)
    assert torch.isfinite(out[:, :, :3]).all() and torch.isnan(out[:, :, 3:]).all()
    v[:, :, 3] = 1e37
    torch.manual_seed(0)
    out = fn(q, k, v, is_causal=True)
    assert torch.isfinite(out).all(), "finite values whose sum overflows were treated as non-finite"


@pytest.mark.parametrize("op", list(OPS))
def test_a_key_every_query_sees_poisons_every_row(op):
    """Without hidden keys (one decoding step, no padding) nothing is cleaned: the nan reaches every output."""
    fn = OPS[op]
    q, k, v = _poisoned(1, where=4, value=float("nan"), in_value=False)
    assert torch.isnan(fn(q, k, v, is_causal=True)).all()
    assert torch.isnan(fn(q, k, v)).all()
