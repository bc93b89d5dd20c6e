"""Second derivatives through every op and backend: equal to the float64 reference's, or a clear error (issue 33, 2).

Every custom autograd.Function in ops/ (the kernel-with-sink Function, the epilogue) is once-differentiable: a
gradient taken with create_graph=True that is differentiated again raises instead of returning a Hessian-vector
product that silently misses the backward's own dependence on its inputs. Paths without a custom Function (torch's
SDPA for plain softmax) are torch's: its CPU flash kernel refuses too ("derivative ... not implemented"); where torch
differentiates twice, the result must equal the reference's.
"""
import pytest
import torch
from torch.autograd import gradcheck

from affine_attention.ops import (
    affine_scaled_attention, affine_scaled_attention_reference, sink_attention, sink_attention_reference,
    softmax_attention, softmax_attention_reference,
)
from affine_attention.ops.backends import KernelAttention, backend_names
from affine_attention.ops.epilogue import _Epilogue

CPU_BACKENDS = [n for n in backend_names() if n != "cuda_flash"]
REFUSAL = "second derivative|not implemented"


def _inputs(B=1, H=2, T=5, D=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    alpha = torch.rand(B, H, T, generator=gen, dtype=torch.float64)
    alpha_ma = torch.rand(H, generator=gen, dtype=torch.float64)
    sinks = torch.randn(H, generator=gen, dtype=torch.float64)
    dense = torch.rand(B, 1, T, T, generator=gen) > 0.3
    dense[..., 0] = True
    return q, k, v, alpha, alpha_ma, sinks, dense


OPS = {
    "softmax": (lambda q, k, v, a, am, s, **kw: softmax_attention(q, k, v, **kw),
                lambda q, k, v, a, am, s, **kw: softmax_attention_reference(q, k, v, **kw)[0]),
    "sink": (lambda q, k, v, a, am, s, **kw: sink_attention(q, k, v, s, **kw),
             lambda q, k, v, a, am, s, **kw: sink_attention_reference(q, k, v, s, **kw)[0]),
    "affine": (lambda q, k, v, a, am, s, **kw: affine_scaled_attention(q, k, v, a, am, **kw),
               lambda q, k, v, a, am, s, **kw: affine_scaled_attention_reference(q, k, v, a, am, **kw)[0]),
}


def _hvp(fn, q, k, v, a, am, s, kw, gen):
    """d/d(q, k, v) of <grad_q(out . w), u>: a Hessian-vector product through the op's backward."""
    out = fn(q, k, v, a, am, s, **kw)
    w = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    dq, = torch.autograd.grad(out, q, w, create_graph=True)
    u = torch.randn(dq.shape, generator=gen, dtype=dq.dtype)
    return torch.autograd.grad(dq, (q, k, v), u, allow_unused=True)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("mask", ["causal", "dense"])
def test_second_derivative_is_right_or_refused(op, mask):
    fast, ref = OPS[op]
    q, k, v, a, am, s, dense = _inputs()
    kw = dict(is_causal=True) if mask == "causal" else dict(attn_mask=dense)
    want = _hvp(ref, q, k, v, a, am, s, kw, torch.Generator().manual_seed(5))
    for backend in [None] + CPU_BACKENDS:
        try:
            out = fast(q, k, v, a, am, s, backend=backend, **kw)
        except ValueError:  # this backend cannot serve the mask / op: it says so
            continue
        del out
        try:
            got = _hvp(lambda *x, **y: fast(*x, backend=backend, **y), q, k, v, a, am, s, kw,
                       torch.Generator().manual_seed(5))
        except RuntimeError as e:
            assert any(w in str(e) for w in REFUSAL.split("|")), f"{op} {backend}: unclear refusal: {e}"
            continue
        for name, g, w in zip("qkv", got, want):
            w = torch.zeros_like(q) if w is None else w
            g = torch.zeros_like(q) if g is None else g
            torch.testing.assert_close(g, w, atol=1e-8, rtol=1e-6,
                                       msg=lambda m: f"{op} on {backend} ({mask}): second derivative d{name}: {m}")


def test_issue_exact_dense_hvp_is_not_silently_wrong():
    """The issue's case: exact (the automatic choice for dense masks) returned an HVP off by ~0.2 with no error."""
    q, k, v, a, am, s, dense = _inputs(T=6, seed=3)
    with pytest.raises(RuntimeError, match=REFUSAL):
        _hvp(lambda *x, **y: softmax_attention(*x[:3], **y), q, k, v, a, am, s, dict(attn_mask=dense),
             torch.Generator().manual_seed(0))


def test_every_custom_function_is_marked_once_differentiable():
    """Each custom autograd.Function's backward refuses a second derivative (the decision in docs/reliability.md)."""
    for fn in (KernelAttention, _Epilogue):
        assert getattr(fn.backward, "__wrapped__", None) is not None, f"{fn.__name__}.backward is not wrapped"


@pytest.mark.parametrize("op", list(OPS))
def test_first_derivative_still_exact_in_float64(op):
    """Marking once-differentiable leaves the first derivative exact (gradcheck against finite differences)."""
    fast, _ = OPS[op]
    q, k, v, a, am, s, _ = _inputs(T=4, D=3)
    assert gradcheck(lambda q, k, v: fast(q, k, v, a, am, s, is_causal=True, backend="exact"), (q, k, v))
