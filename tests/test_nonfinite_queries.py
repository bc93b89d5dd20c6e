"""Non-finite queries (issue 33, item 3): one rule on every backend, equal to the float64 reference.

The rule (docs/reliability.md): a nan or inf in a query's q row or its alpha makes exactly that query's output nan; a
nan sink logit makes every query of its head nan (an inf sink means what the definition says: +inf takes all the
mass, -inf none); a gate multiplies elementwise; non-finite keys and values poison the queries that see them.
Nothing a query does not depend on changes.
"""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from affine_attention.ops import (
    affine_scaled_attention, affine_scaled_attention_reference, sink_attention, sink_attention_reference,
    softmax_attention, softmax_attention_reference,
)
from affine_attention.ops.attention import attention_with_epilogue
from affine_attention.ops.backends import backend_names

CPU_BACKENDS = [n for n in backend_names() if n != "cuda_flash"]
B, H, T, D = 2, 2, 7, 4


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=gen, dtype=torch.float64) for _ in range(3))
    return dict(q=q, k=k, v=v, alpha=torch.rand(B, H, T, generator=gen, dtype=torch.float64),
                alpha_ma=torch.rand(H, generator=gen, dtype=torch.float64),
                sinks=torch.randn(H, generator=gen, dtype=torch.float64))


def _fast(op, x, **kw):
    f = {n: t.float() for n, t in x.items()}
    if op == "softmax":
        return softmax_attention(f["q"], f["k"], f["v"], **kw)
    if op == "sink":
        return sink_attention(f["q"], f["k"], f["v"], f["sinks"], **kw)
    return affine_scaled_attention(f["q"], f["k"], f["v"], f["alpha"], f["alpha_ma"], **kw)


def _ref(op, x, **kw):
    if op == "softmax":
        return softmax_attention_reference(x["q"], x["k"], x["v"], **kw)[0]
    if op == "sink":
        return sink_attention_reference(x["q"], x["k"], x["v"], x["sinks"], **kw)[0]
    return affine_scaled_attention_reference(x["q"], x["k"], x["v"], x["alpha"], x["alpha_ma"], **kw)[0]


# (tensor, index, ops it applies to, the queries it poisons as a (B, H, T) bool)
def _placements():
    one = torch.zeros(B, H, T, dtype=torch.bool)
    q_row = one.clone()
    q_row[1, 0, 3] = True
    head = one.clone()
    head[:, 1] = True
    return [("q", (1, 0, 3, 2), ("softmax", "sink", "affine"), q_row),
            ("alpha", (1, 0, 3), ("affine",), q_row),
            ("sinks", (1,), ("sink",), head)]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("placement", range(3))
@pytest.mark.parametrize("mask", ["causal", "none", "padding"])
@pytest.mark.parametrize("path", ["eager_cpu", "accelerator"])
def test_nonfinite_query_inputs_follow_one_rule_on_every_backend(monkeypatch, value, placement, mask, path):
    """path: "accelerator" takes the rule's path for devices where reading a value would sync (ops/nonfinite.py)."""
    from affine_attention.ops import nonfinite

    monkeypatch.setattr(nonfinite, "_asks", lambda t: path == "eager_cpu" and t.device.type == "cpu")
    name, index, ops, poisoned = _placements()[placement]
    kw = {"causal": dict(is_causal=True), "none": {}}.get(mask)
    if kw is None:
        km = torch.ones(B, 1, 1, T, dtype=torch.bool)
        km[0, ..., :2] = False
        kw = dict(attn_mask=km, is_causal=True)
    x = _inputs()
    x[name] = x[name].clone()
    x[name][index] = value
    for op in ops:
        want = _ref(op, x, **kw)
        if name == "sinks" and value != value:
            assert want[poisoned].isnan().all(), "the reference must give nan for a nan sink"
        elif name != "sinks":
            assert want[poisoned].isnan().all(), f"reference {op}: {name} = {value} must make the query nan"
        for backend in [None] + CPU_BACKENDS:
            try:
                got = _fast(op, x, backend=backend, **kw)
            except ValueError:
                continue  # this backend cannot serve the op or mask, and says so
            where = f"{op} on {backend} ({mask}), {name}{list(index)} = {value}"
            assert torch.equal(got.isnan(), want.isnan()), f"{where}: nan at {got.isnan().nonzero().tolist()}, " \
                                                           f"reference nan at {want.isnan().nonzero().tolist()}"
            fin = ~want.isnan()
            torch.testing.assert_close(got[fin].double(), want[fin], atol=2e-5, rtol=2e-5,
                                       msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("backend", ["sdpa", "cpu_flash"])
def test_issue_nan_query_row_is_nan_on_sdpa_and_cpu_flash(backend):
    """The issue's case: a nan in one query row returned 0.0 (softmax) on sdpa and cpu_flash."""
    x = _inputs(1)
    q = x["q"].float().clone()
    q[0, 1, 4, 0] = float("nan")
    out = softmax_attention(q, x["k"].float(), x["v"].float(), is_causal=True, backend=backend)
    assert out[0, 1, 4].isnan().all(), f"the nan query's output is {out[0, 1, 4].tolist()}"
    assert not out[0, 1, :4].isnan().any() and not out[0, 1, 5:].isnan().any() and not out[1].isnan().any()
    with sdpa_kernel(SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), x["k"], x["v"], is_causal=True)
    assert ref[0, 1, 4].isnan().all()  # torch's math SDPA agrees


def test_nan_gate_poisons_its_elements_only():
    x = _inputs(2)
    q, k, v = (x[n].float() for n in "qkv")
    gate = torch.rand(B, H, T, D)
    gate[1, 1, 2, 3] = float("nan")
    out = attention_with_epilogue(q, k, v, gate=gate, is_causal=True)
    assert out.isnan().nonzero().tolist() == [[1, 1, 2, 3]]
