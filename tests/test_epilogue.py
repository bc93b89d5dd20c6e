"""The variant epilogue (ops/epilogue.py): its hand-written backward against autograd of the readable formula, the
ops and variants that run through it against the reference in float64, and the dispatch. The Triton kernels are
tested in test_triton_kernels.py."""
import importlib.util

import pytest
import torch

from affine_attention.ops import affine_scaled_attention, affine_scaled_attention_reference
from affine_attention.ops import sink_attention_reference
from affine_attention.ops.attention import attention_with_epilogue
from affine_attention.ops.epilogue import epilogue, select_impl, use_epilogue
from conftest import make_qkv
from test_variants import _perturbed


def _assert_same_grads(out, ref, inputs, w=None, tol=1e-10):
    """Outputs and the gradient of every input (None where unused on both sides) agree within tol."""
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    w = torch.randn_like(out) if w is None else w
    for a, b in zip(torch.autograd.grad(out, inputs, w, allow_unused=True),
                    torch.autograd.grad(ref, inputs, w, allow_unused=True)):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _formula(o, a, am, m, g):
    """The readable epilogue: g * (a * o + (alpha_ma - a) * m), m repeated over each query group."""
    y = o
    if a is not None:
        mm = m.repeat_interleave(o.shape[1] // m.shape[1], dim=1)
        y = a[..., None] * o + (am[None, :, None, None] - a[..., None]) * mm
    return y if g is None else y * g


def _operands(B, Hq, Hm, T, Tm, D, gate_shape, affine=True, dtype=torch.float64):
    o = torch.randn(B, Hq, T, D, dtype=dtype, requires_grad=True)
    # alpha as the variants make it: a transposed (B, T, Hq) projection, i.e. not contiguous.
    a = torch.rand(B, T, Hq, dtype=dtype).transpose(1, 2).requires_grad_() if affine else None
    am = torch.rand(Hq, dtype=dtype, requires_grad=True) if affine else None
    m = torch.randn(B, Hm, Tm, D, dtype=dtype, requires_grad=True) if affine else None
    g = torch.rand(*gate_shape, dtype=dtype, requires_grad=True) if gate_shape else None
    return o, a, am, m, g


CASES = {
    "affine-mha": (2, 3, 3, 5, 5, 7, None, True),
    "affine-gqa-elementwise": (2, 4, 2, 5, 5, 7, (2, 4, 5, 7), True),
    "affine-gqa-headwise-decode-mean": (2, 4, 1, 3, 1, 6, (2, 4, 3, 1), True),
    "affine-per-head-scale": (1, 4, 2, 1, 1, 8, (1, 4, 1, 1), True),
    "gate-only": (2, 4, 4, 6, 6, 5, (2, 4, 6, 5), False),
    "headwise-gate-only": (2, 4, 4, 6, 6, 5, (2, 4, 6, 1), False),
}


@pytest.mark.parametrize("case", CASES)
def test_eager_epilogue_matches_autograd_of_the_formula(case):
    B, Hq, Hm, T, Tm, D, gs, affine = CASES[case]
    ops = _operands(B, Hq, Hm, T, Tm, D, gs, affine)
    o, a, am, m, g = ops
    out = epilogue(o, alpha=a, alpha_ma=am, v_mean=m, gate=g, impl="eager")
    _assert_same_grads(out, _formula(*ops), [t for t in ops if t is not None], tol=1e-12)
    torch.autograd.gradcheck(lambda *t: epilogue(t[0], alpha=t[1], alpha_ma=t[2], v_mean=t[3], gate=t[4],
                                                 impl="eager"), ops)


@pytest.mark.parametrize("Hm", [4, 2, 1])
@pytest.mark.parametrize("gate_shape", [None, (2, 4, 1, 6), (2, 4, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_one_decoding_query_without_grad_matches_the_formula(Hm, gate_shape, dtype):
    """T = 1 with the mean given and nothing to differentiate (a decoding step): the forward without autograd."""
    o, a, am, m, g = (None if t is None else t.detach() for t in _operands(2, 4, Hm, 1, 1, 6, gate_shape))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    with torch.no_grad():
        out = epilogue(o.to(dtype), alpha=a.to(acc), alpha_ma=am.to(acc), v_mean=m.to(acc),
                       gate=None if g is None else g.to(dtype), impl="eager")
    ref = _formula(o.to(dtype).double(), a.to(acc).double(), am.to(acc).double(), m.to(acc).double(),
                   None if g is None else g.to(dtype).double())
    assert out.dtype == dtype and out.shape == (2, 4, 1, 6)
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alpha_equal_to_alpha_ma_returns_the_softmax_output_bit_for_bit(T, dtype):
    """alpha == alpha_ma (a function-preserving retrofit) makes the bias weight exactly 0, so the output must be
    out itself, not out - m + m rounded: 30 layers amplify that rounding to 1e-4 in the logits."""
    o, a, am, m, _ = _operands(2, 4, 2, T, T, 6, None, dtype=torch.float32)
    am = torch.full_like(am, 1.0)
    a = torch.ones_like(a)
    with torch.no_grad():
        out = epilogue(o.to(dtype), alpha=a.detach(), alpha_ma=am, v_mean=m.detach() * 100, impl="eager")
    assert torch.equal(out, o.detach().to(dtype))


def test_constant_float_gate_and_identity():
    o, a, am, m, _ = _operands(1, 2, 2, 3, 3, 4, None)
    torch.testing.assert_close(epilogue(o, alpha=a, alpha_ma=am, v_mean=m, gate=0.5), 0.5 * _formula(o, a, am, m, None))
    assert epilogue(o) is o


def _masks(B, S, kind):
    if kind == "pad":
        m = torch.ones(B, 1, 1, S, dtype=torch.bool)
        m[1, ..., :3] = False
        return dict(attn_mask=m, is_causal=True)
    if kind == "window":
        return dict(is_causal=True, window=4)
    if kind == "documents":
        return dict(is_causal=True, document_ids=torch.tensor([[0] * 5 + [1] * (S - 5)] * B))
    return dict(is_causal=kind == "causal")


def _gate(kind, B, Hq, T, D):
    if kind == "elementwise":
        return torch.rand(B, Hq, T, D, dtype=torch.float64, requires_grad=True)
    if kind == "headwise":
        return torch.rand(B, Hq, T, 1, dtype=torch.float64, requires_grad=True)
    return None


@pytest.mark.parametrize("gate", [None, "elementwise", "headwise"])
@pytest.mark.parametrize("Hkv, T, S, mask", [(2, 13, 13, "causal"), (4, 13, 13, "pad"), (2, 5, 12, "causal"),
                                              (2, 1, 9, "causal"), (2, 7, 7, "none"), (2, 11, 11, "window"),
                                              (1, 9, 9, "documents")])
@pytest.mark.parametrize("bias_norm", ["visible", "full"])
def test_op_with_gate_matches_reference_outputs_and_every_gradient(gate, Hkv, T, S, mask, bias_norm):
    B, Hq, D = 2, 4, 6
    q, k, v = make_qkv(B, Hq, Hkv, T, S, D)
    alpha = torch.rand(B, Hq, T, dtype=torch.float64, requires_grad=True)
    alpha_ma = torch.rand(Hq, dtype=torch.float64, requires_grad=True)
    g = _gate(gate, B, Hq, T, D)
    kw = dict(_masks(B, S, mask), enable_gqa=Hkv != Hq, bias_norm=bias_norm)
    out = attention_with_epilogue(q, k, v, alpha=alpha, alpha_ma=alpha_ma, gate=g, **kw)
    ref = affine_scaled_attention_reference(q, k, v, alpha, alpha_ma, **kw)[0]
    ref = ref if g is None else ref * g
    _assert_same_grads(out, ref, [t for t in (q, k, v, alpha, alpha_ma, g) if t is not None])


def test_sink_with_gate_runs_through_the_kernel_then_the_epilogue():
    B, Hq, Hkv, T, D = 2, 4, 2, 9, 6
    q, k, v = make_qkv(B, Hq, Hkv, T, T, D)
    sinks = torch.randn(Hq, dtype=torch.float64, requires_grad=True)
    g = _gate("elementwise", B, Hq, T, D)
    out = attention_with_epilogue(q, k, v, sinks=sinks, gate=g, is_causal=True, enable_gqa=True)
    ref = sink_attention_reference(q, k, v, sinks, is_causal=True, enable_gqa=True)[0] * g
    _assert_same_grads(out, ref, [q, k, v, sinks, g])


def test_precomputed_v_mean_gets_its_gradient():
    B, Hq, Hkv, S, D = 1, 4, 2, 8, 5
    q, k, v = make_qkv(B, Hq, Hkv, 1, S, D)
    alpha = torch.rand(B, Hq, 1, dtype=torch.float64)
    am = torch.rand(Hq, dtype=torch.float64)
    v_mean = v.detach().mean(-2, keepdim=True).requires_grad_()
    out = affine_scaled_attention(q, k, v, alpha, am, is_causal=True, enable_gqa=True, v_mean=v_mean)
    ref = affine_scaled_attention_reference(q, k, v, alpha, am, is_causal=True, enable_gqa=True)[0]
    torch.testing.assert_close(out, ref)
    (dm,) = torch.autograd.grad(out.sum(), v_mean)
    b = (am[None, :, None] - alpha).view(B, Hkv, 2, 1).sum(2)  # summed over each query group
    torch.testing.assert_close(dm, b[..., None].expand(B, Hkv, 1, D))


VARIANTS = [("gated", {}), ("gated", {"gate": "headwise"}), ("affine", {}), ("affine_gated", {}),
            ("affine_gated", {"gate": "headwise"}), ("scaled_softmax", {}), ("scaled_softmax", {"learnable": True}),
            ("affine_frozen", {})]


@pytest.mark.parametrize("name, options", VARIANTS, ids=[f"{n}-{o}" for n, o in VARIANTS])
@pytest.mark.parametrize("T, S", [(6, 11), (10, 10)])
def test_variants_run_one_epilogue_and_match_their_reference(name, options, T, S):
    m = _perturbed(name, options)  # new parameters and alpha_ma away from their init, in eval mode
    B = 2
    q, k, v = make_qkv(B, 4, 2, T, S, 8)
    x = torch.randn(B, T, 24, dtype=torch.float64, requires_grad=True)
    out = m(q, k, v, x, is_causal=True)
    # The gate, the per-head scale and the affine combine are one autograd node, not a chain of eager passes.
    assert type(out.grad_fn).__name__ == "_EpilogueBackward"
    _assert_same_grads(out, m.reference(q, k, v, x, is_causal=True)[0], [q, k, v, x] + list(m.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hkv", [4, 2])
def test_low_precision_keeps_dtypes_and_stays_close_to_float64(dtype, Hkv):
    B, Hq, T, D = 2, 4, 33, 16
    q, k, v = make_qkv(B, Hq, Hkv, T, T, D, dtype=torch.float64, requires_grad=False)
    alpha = torch.rand(B, Hq, T, dtype=torch.float64)
    am = torch.rand(Hq, dtype=torch.float64)
    g = torch.rand(B, Hq, T, D, dtype=torch.float64)
    keys = torch.ones(B, 1, 1, T, dtype=torch.bool)
    keys[1, ..., :4] = False
    kw = dict(attn_mask=keys, is_causal=True, enable_gqa=Hkv != Hq)
    w = torch.randn(B, Hq, T, D, dtype=torch.float64)
    ins64 = [t.clone().requires_grad_() for t in (q, k, v, alpha, g)]
    ref = affine_scaled_attention_reference(*ins64[:3], ins64[3], am, **kw)[0] * ins64[4]
    grads64 = torch.autograd.grad(ref, ins64, w)
    low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    a32, g_low = alpha.float().requires_grad_(), g.to(dtype).requires_grad_()
    out = attention_with_epilogue(*low, alpha=a32, alpha_ma=am.float(), gate=g_low, **kw)
    assert out.dtype == dtype
    grads = torch.autograd.grad(out, low + [a32, g_low], w.to(dtype))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    for x, want, ref_grad in zip(grads, low + [a32, g_low], grads64):
        assert x.dtype == want.dtype
        torch.testing.assert_close(x.double(), ref_grad, rtol=tol, atol=tol * max(1.0, ref_grad.abs().max().item()))


def test_non_contiguous_incoming_gradient():
    """The gradient arriving from `out.transpose(1, 2).contiguous()` (the transformers seam) is a strided view."""
    B, Hq, Hkv, T, D = 2, 4, 2, 7, 6
    q, k, v = make_qkv(B, Hq, Hkv, T, T, D)
    alpha = torch.rand(B, Hq, T, dtype=torch.float64, requires_grad=True)
    am = torch.rand(Hq, dtype=torch.float64)
    out = affine_scaled_attention(q, k, v, alpha, am, is_causal=True, enable_gqa=True)
    ref = affine_scaled_attention_reference(q, k, v, alpha, am, is_causal=True, enable_gqa=True)[0]
    inputs = [q, k, v, alpha]
    ga = torch.autograd.grad(out.transpose(1, 2).contiguous().square().sum(), inputs)
    gr = torch.autograd.grad(ref.transpose(1, 2).contiguous().square().sum(), inputs)
    for x, y in zip(ga, gr):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


def test_dispatch_is_explicit(monkeypatch):
    cpu = torch.device("cpu")
    assert select_impl(cpu) == "eager"
    if importlib.util.find_spec("triton") is not None:
        assert select_impl(torch.device("cuda")) == "triton"  # chosen by device type: needs no GPU to check
    assert select_impl(torch.device("meta")) == "eager"
    with pytest.raises(ValueError, match="impl must be one of"):
        select_impl(cpu, "fused")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_impl(cpu, "triton")
    with use_epilogue("triton"), pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        epilogue(torch.zeros(1, 1, 1, 1), gate=0.5)
    with pytest.raises(ValueError, match="alpha_ma"):
        epilogue(torch.zeros(1, 2, 3, 4), alpha=torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="gate must have rank 4"):
        epilogue(torch.zeros(1, 2, 3, 4), gate=torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="v_mean must have shape"):
        epilogue(torch.zeros(1, 2, 3, 4), alpha=torch.zeros(1, 2, 3), alpha_ma=torch.zeros(2),
                 v_mean=torch.zeros(1, 2, 2, 4))
