"""Every backend gives the same answer for every memory layout of the same values (issue 33, item 1).

q/k/v arrive as views: transposed from (B, H, D, T) storage (head dim not stride 1), expanded over heads (stride 0),
sliced with a storage offset. The dispatcher makes each backend's inputs acceptable once (or refuses); the outputs
and gradients must equal those of contiguous copies of the same values.
"""
import pytest
import torch

from affine_attention.ops import affine_scaled_attention, sink_attention, softmax_attention
from affine_attention.ops.backends import backend_names, get_backend

CPU_BACKENDS = [n for n in backend_names() if n != "cuda_flash"]


# Each layout: the shape it is stored in, and the view that presents it as (B, H, T, D).
LAYOUTS = {
    "transposed": (lambda B, H, T, D: (B, H, D, T), lambda x, B, H, T, D: x.transpose(-1, -2)),  # D not stride 1
    "expanded": (lambda B, H, T, D: (B, 1, T, D), lambda x, B, H, T, D: x.expand(B, H, T, D)),  # stride 0 over H
    "expanded_d": (lambda B, H, T, D: (B, H, T, 1), lambda x, B, H, T, D: x.expand(B, H, T, D)),  # stride 0 on D
    "offset": (lambda B, H, T, D: (B, H, T + 3, D + 5), lambda x, B, H, T, D: x[:, :, 2:T + 2, 1:D + 1]),
    "permuted": (lambda B, H, T, D: (T, B, H, D), lambda x, B, H, T, D: x.permute(1, 2, 0, 3)),
}


def _view(B, H, T, D, kind, gen):
    """(leaf, view): a float32 leaf tensor and a (B, H, T, D) view of it laid out as `kind` says."""
    stored, view = LAYOUTS[kind]
    leaf = torch.randn(stored(B, H, T, D), generator=gen).requires_grad_()
    return leaf, view(leaf, B, H, T, D)


OPS = {
    "softmax": lambda q, k, v, kw: softmax_attention(q, k, v, **kw),
    "sink": lambda q, k, v, kw: sink_attention(q, k, v, torch.tensor([0.3, -0.5], dtype=q.dtype), **kw),
    "affine": lambda q, k, v, kw: affine_scaled_attention(
        q, k, v, torch.linspace(0.1, 0.9, 2 * q.shape[2], dtype=q.dtype).view(1, 2, -1).expand(q.shape[0], -1, -1),
        torch.tensor([0.4, 0.6], dtype=q.dtype), **kw),
}
MASKS = {"causal": dict(is_causal=True), "padding": "padding"}


def _kw(mask, B, T):
    if mask == "padding":
        km = torch.ones(B, 1, 1, T, dtype=torch.bool)
        km[0, ..., :3] = False
        return dict(attn_mask=km, is_causal=True)
    return dict(MASKS[mask])


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("mask", list(MASKS))
def test_every_backend_reads_every_layout(kind, op, mask):
    """Outputs and gradients on a strided view equal those on a contiguous copy of the same values, and a second
    call gives the same bits."""
    B, H, T, D = 2, 2, 11, 8
    gen = torch.Generator().manual_seed(0)
    leaves, views = zip(*(_view(B, H, T, D, kind, gen) for _ in range(3)))
    flat = [x.detach().contiguous().requires_grad_() for x in views]
    g = torch.randn(B, H, T, D, generator=gen)
    for name in CPU_BACKENDS:
        kw = dict(_kw(mask, B, T), backend=name)
        try:
            want = OPS[op](*flat, kw)
        except ValueError:  # the backend cannot serve this mask or op at all, and says so
            continue
        # the gradient on each leaf is the contiguous copy's gradient mapped back through the view
        mapped = [torch.autograd.grad(LAYOUTS[kind][1](leaf, B, H, T, D), leaf, gw)[0]
                  for leaf, gw in zip(leaves, torch.autograd.grad(want, flat, g))]
        got = OPS[op](*views, kw)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} {op} {kind}: {m}")
        for leaf, gg, gw in zip("qkv", torch.autograd.grad(got, leaves, g), mapped):
            torch.testing.assert_close(gg, gw, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name} {op} {kind} d{leaf}: {m}")
        again = OPS[op](*views, kw)  # the bug read memory that was not the input: a second call differed
        assert torch.equal(again, got), f"{name} {op} {kind}: a second call with the same inputs differs"


def test_issue_sink_with_head_dim_not_stride_one_on_auto_and_cpu_flash():
    """The issue's case: (B, H, D, T) storage transposed; auto and cpu_flash returned garbage, different per call."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 16, 9, generator=gen).transpose(-1, -2) for _ in range(3))
    sinks = torch.tensor([0.1, -0.2, 0.3])
    want = sink_attention(q.contiguous(), k.contiguous(), v.contiguous(), sinks, is_causal=True, backend="exact")
    for backend in (None, "cpu_flash"):
        for _ in range(3):
            got = sink_attention(q, k, v, sinks, is_causal=True, backend=backend)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_issue_affine_with_q_expanded_over_the_head_dim_and_key_padding():
    gen = torch.Generator().manual_seed(2)
    B, H, T, D = 2, 4, 10, 8
    q = torch.randn(B, H, T, 1, generator=gen).expand(B, H, T, D)  # stride 0 on the head dim D
    k, v = (torch.randn(B, H, T, D, generator=gen) for _ in range(2))
    alpha = torch.rand(B, H, T, generator=gen)
    alpha_ma = torch.rand(H, generator=gen)
    km = torch.ones(B, 1, 1, T, dtype=torch.bool)
    km[1, ..., :4] = False
    want = affine_scaled_attention(q.contiguous(), k, v, alpha, alpha_ma, attn_mask=km, is_causal=True,
                                   backend="exact")
    got = affine_scaled_attention(q, k, v, alpha, alpha_ma, attn_mask=km, is_causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_no_copy_when_the_layout_is_already_acceptable():
    """An acceptable input is handed to the kernel as is: fitting is a no-op (same object)."""
    from affine_attention.ops.backends import fit_layout
    x = torch.randn(2, 3, 5, 4)
    for name in CPU_BACKENDS:
        assert fit_layout(get_backend(name), x) is x
    bad = torch.randn(2, 3, 4, 5).transpose(-1, -2)
    assert fit_layout(get_backend("cpu_flash"), bad).is_contiguous()
