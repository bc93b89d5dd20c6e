"""No tensor of T x S elements on the CPU fast paths: every allocation of forward + backward is recorded by a
TorchDispatchMode at T = S = 4096 for causal, padding, a window of 512 and 8 packed documents."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from affine_attention.ops import affine_scaled_attention, affine_scaled_attention_reference, sink_attention

T = S = 4096


class LargestAllocation(TorchDispatchMode):
    """Records the largest storage (in elements) any op returns; views share their base's storage."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                n = t.untyped_storage().nbytes() // t.element_size()
                if n > self.largest:
                    self.largest, self.op = n, func
        return out


def _inputs():
    B, Hq, Hkv, D = 1, 2, 1, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, T, D, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, generator=g, requires_grad=True)
    alpha = torch.rand(B, Hq, T, generator=g, requires_grad=True)
    return q, k, v, alpha, torch.full((Hq,), 0.5), torch.zeros(Hq, requires_grad=True)


def _masks(kind):
    if kind == "causal":
        return dict(is_causal=True)
    if kind == "padding":
        pad = torch.ones(1, 1, 1, S, dtype=torch.bool)
        pad[..., :100] = False
        return dict(is_causal=True, attn_mask=pad)
    if kind == "window":
        return dict(is_causal=True, window=512)
    return dict(is_causal=True, document_ids=(torch.arange(S) // (S // 8))[None])


def _run(op, kw):
    q, k, v, alpha, alpha_ma, sinks = _inputs()
    with LargestAllocation() as rec:
        if op == "affine":
            out = affine_scaled_attention(q, k, v, alpha, alpha_ma, enable_gqa=True, **kw)
        else:
            out = sink_attention(q, k, v, sinks, enable_gqa=True, **kw)
        out.backward(torch.ones_like(out))
    return rec


@pytest.mark.parametrize("kind", ["causal", "padding", "window", "documents"])
@pytest.mark.parametrize("op", ["affine", "sink"])
def test_largest_tensor_is_far_below_t_by_s(op, kind):
    rec = _run(op, _masks(kind))
    assert rec.largest <= T * S // 32, f"{rec.op} allocated {rec.largest} elements (T x S = {T * S})"


def test_the_recorder_sees_a_t_by_s_tensor():
    """The reference materialises its weights: the same recorder must flag it, so the test above can fail."""
    q, k, v, alpha, alpha_ma, _ = _inputs()
    with torch.no_grad(), LargestAllocation() as rec:
        affine_scaled_attention_reference(q, k, v, alpha, alpha_ma, enable_gqa=True, **_masks("window"))
    assert rec.largest >= T * S
