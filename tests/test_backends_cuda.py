"""cuda_flash without a GPU: the aten calls on meta tensors (shapes, dtypes, lse layout, the backward's wiring), its
varlen plans through a CPU model of the kernel against the float64 reference, and what `supports` accepts. With a
GPU (`-m cuda`), the real kernel in bf16 against the float64 reference on outputs and every gradient."""

import pytest
import torch

from affine_attention.ops import (
    affine_scaled_attention, affine_scaled_attention_reference, sink_attention, sink_attention_reference,
    softmax_attention, softmax_attention_reference,
)
from affine_attention.ops.backends import BACKENDS, Call, KernelAttention, get_backend, select
from affine_attention.ops.backends import cuda_flash
from affine_attention.ops.call import Score
from affine_attention.ops.masks import parse_mask
from conftest import make_qkv

CUDA = torch.cuda.is_available()
BACKEND = get_backend("cuda_flash")


# --- a CPU model of FA2's contract (float32 math, float64 for float64 inputs): per-segment bottom-right alignment,
# window, lse = +inf on empty rows (whose out and dq it fills with garbage: the backend's own zeroing is tested) ---

GARBAGE = 123.0  # what the model writes into rows that see no key


def _segments(x, cu):
    """Dense (B, L, H, D) -> per batch row; varlen (total, H, D) + cu -> per segment: list of (L, H, D) slices."""
    if cu is None:
        return [(b, slice(None)) for b in range(x.shape[0])]
    cu = cu.tolist()
    return [(None, slice(cu[i], cu[i + 1])) for i in range(len(cu) - 1)]


def _take(x, where):
    b, sl = where
    return x[b][sl] if b is not None else x[sl]


def _acc(*xs):
    """The kernel computes in float32 (float64 here for float64 inputs) and rounds its outputs once."""
    return [x.to(torch.float64 if x.dtype == torch.float64 else torch.float32) for x in xs]


def _weights(q, k, causal, scale, left, right, lse=None):
    """q: (Lq, H, D), k: (Lk, Hkv, D) -> p (H, Lq, Lk), lse (H, Lq), k repeated over its query group."""
    G = q.shape[1] // k.shape[1]
    kr = k.repeat_interleave(G, dim=1)
    s = torch.einsum("thd,shd->hts", q, kr) * scale
    Lq, Lk = q.shape[0], k.shape[0]
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None]
    right = 0 if causal else right
    vis = torch.ones(Lq, Lk, dtype=torch.bool)
    if right >= 0:
        vis &= j <= i + Lk - Lq + right
    if left >= 0:
        vis &= j >= i + Lk - Lq - left
    s = s.masked_fill(~vis, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, -1)
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    return torch.exp(s - lse[..., None]), lse, kr, G


def model_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
                  window_size_left=None, window_size_right=None):
    assert dropout_p == 0.0 and not return_debug_mask
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    dtype, (q, k, v) = q.dtype, _acc(q, k, v)
    out = torch.zeros_like(q)
    H = q.shape[-2]
    lse = torch.zeros((q.shape[0], H, q.shape[1]) if cu_q is None else (H, q.shape[0]), dtype=q.dtype)
    for wq, wk in zip(_segments(q, cu_q), _segments(k, cu_k), strict=True):
        qs, ks, vs = _take(q, wq), _take(k, wk), _take(v, wk)
        assert cu_q is None or (qs.shape[0] <= max_q and ks.shape[0] <= max_k)
        p, l_, _, G = _weights(qs, ks, is_causal, scale, window_size_left, window_size_right)
        o = torch.einsum("hts,shd->thd", p, vs.repeat_interleave(G, dim=1))
        o = o.masked_fill(torch.isinf(l_).t()[..., None], GARBAGE)  # the backend must not rely on the kernel's 0
        if cu_q is None:
            out[wq[0]], lse[wq[0]] = o, l_
        else:
            out[wq[1]], lse[:, wq[1]] = o, l_
    return out.to(dtype), lse.to(q.dtype), None, None, None


def model_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng, unused, *,
                   scale=None, window_size_left=None, window_size_right=None):
    """FA2's backward from the given out and lse: row term D_i = dO_i . out_i (the sink trick relies on it)."""
    assert not torch.isneginf(lse).any(), "the kernel marks empty rows with lse = +inf"
    dtype, (dout, q, k, v, out) = q.dtype, _acc(dout, q, k, v, out)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for wq, wk in zip(_segments(q, cu_q), _segments(k, cu_k), strict=True):
        qs, ks, vs = _take(q, wq), _take(k, wk), _take(v, wk)
        ls = lse[wq[0]] if cu_q is None else lse[:, wq[1]]
        p, _, kr, G = _weights(qs, ks, is_causal, scale, window_size_left, window_size_right, ls)
        do, o = _take(dout, wq), _take(out, wq)
        delta = (do * o).sum(-1).t()  # (H, Lq)
        ds = p * (torch.einsum("thd,shd->hts", do, vs.repeat_interleave(G, dim=1)) - delta[..., None])
        group = (lambda x: x.view(x.shape[0], ks.shape[1], G, x.shape[-1]).sum(2))  # noqa: E731
        g_q = torch.einsum("hts,shd->thd", ds, kr) * scale
        g_q = g_q.masked_fill(torch.isinf(ls).t()[..., None], GARBAGE)
        g_k = group(torch.einsum("hts,thd->shd", ds, qs) * scale)
        g_v = group(torch.einsum("hts,thd->shd", p, do))
        for full, g, w in ((dq, g_q, wq), (dk, g_k, wk), (dv, g_v, wk)):
            if w[0] is not None:
                full[w[0]] = g
            else:
                full[w[1]] = g
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


@pytest.fixture
def cpu_model(monkeypatch):
    """cuda_flash's kernel calls served by the CPU model; `supports` sees a bf16 CUDA call (so its mask
    checks still apply) and the platform check passes."""
    monkeypatch.setattr(cuda_flash, "_ops", lambda: (model_forward, model_backward))
    monkeypatch.setattr(cuda_flash, "_platform_reason", lambda: None)
    supports = cuda_flash.CudaFlashBackend.supports
    monkeypatch.setattr(cuda_flash.CudaFlashBackend, "supports", lambda self, call: supports(
        self, call._replace(device_type="cuda", dtype=torch.bfloat16)))


# --- masks used everywhere below: (name, kwargs builder(B, T, S) -> dict of op keyword arguments) ---

def _docs(B, S, cuts):
    ids = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        for c in cuts[b % len(cuts)]:
            ids[b, c:] += 1
    return ids


def _keys(B, S, spans):
    m = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    for b in range(B):
        a, e = spans[b % len(spans)]
        m[b, ..., a:e] = True
    return m


MASKS = {
    "none": lambda B, T, S: {},
    "causal": lambda B, T, S: {"is_causal": True},
    "window": lambda B, T, S: {"is_causal": True, "window": 5},
    "documents": lambda B, T, S: {"is_causal": True, "document_ids": _docs(B, S, [[3, 9], [S - T + 1]])},
    "documents_open": lambda B, T, S: {"document_ids": _docs(B, S, [[4], [1, 2, S - 2]])},
    "documents_window": lambda B, T, S: {"is_causal": True, "window": 3, "document_ids": _docs(B, S, [[6]])},
    "documents_shared": lambda B, T, S: {"is_causal": True, "document_ids": _docs(1, S, [[2, S - 3]])},  # (1, S)
    "left_pad": lambda B, T, S: {"is_causal": True, "attn_mask": _keys(B, S, [(3, S), (0, S)])},
    "left_pad_window": lambda B, T, S: {"is_causal": True, "window": 4, "attn_mask": _keys(B, S, [(2, S)])},
    "right_pad": lambda B, T, S: {"is_causal": True, "attn_mask": _keys(B, S, [(0, S - 4), (0, S)])},
    "pad_open": lambda B, T, S: {"attn_mask": _keys(B, S, [(2, S - 3), (0, 0)])},  # row 1: no key at all
}
# (B, Hq, Hkv, T, S): GQA, T < S (after a cache), T > S, one decoding query.
SHAPES = [(2, 4, 2, 11, 11), (2, 4, 1, 7, 16), (2, 2, 2, 13, 9), (2, 4, 2, 1, 12)]


def _mask_kwargs(name, B, T, S):
    kw = MASKS[name](B, T, S)
    if T > S and "document_ids" in kw:
        pytest.skip("documents give every query its key position: T <= S")
    return kw


# --- meta tensors: the real aten schemas and meta kernels ---

META_CASES = [("causal", (2, 8, 2, 100, 100)), ("window", (1, 4, 4, 64, 96)), ("documents", (2, 4, 2, 40, 50)),
              ("left_pad", (2, 8, 8, 30, 30)), ("right_pad", (2, 4, 2, 30, 30)), ("none", (1, 4, 1, 1, 33))]


@pytest.mark.parametrize("name,shape", META_CASES, ids=[c[0] for c in META_CASES])
def test_meta_forward_backward_layouts(name, shape, monkeypatch):
    """The aten calls accept our arguments (dense and varlen) and the layouts come back as the contract says."""
    monkeypatch.setattr(cuda_flash, "_platform_reason", lambda: None)
    B, Hq, Hkv, T, S = shape
    D = 64
    kw = MASKS[name](B, T, S)
    mask = parse_mask(kw.get("attn_mask"), kw.get("is_causal", False), B, Hq, T, S, torch.device("cpu"),
                      window=kw.get("window"), document_ids=kw.get("document_ids"))
    q = torch.empty(B, Hq, T, D, dtype=torch.bfloat16, device="meta")
    k = torch.empty(B, Hkv, S, D, dtype=torch.bfloat16, device="meta")
    v = torch.empty_like(k)
    assert BACKEND.supports(Call("cuda", q.dtype, B, Hq, Hkv, T, S, D, mask, True, True)) is None
    out, lse = BACKEND.forward(q, k, v, mask, Score(0.125))
    assert out.shape == (B, Hq, T, D) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    assert lse.shape == (B, Hq, T) and lse.dtype == torch.float32
    dq, dk, dv = BACKEND.backward(torch.empty_like(out), q, k, v, out, lse, mask, Score(0.125))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16


def test_meta_sink_autograd_wiring(monkeypatch):
    """KernelAttention over cuda_flash on meta tensors: every input, the sinks included, gets a gradient."""
    monkeypatch.setattr(cuda_flash, "_platform_reason", lambda: None)
    B, Hq, Hkv, T, S, D = 2, 8, 2, 48, 64, 128
    q = torch.empty(B, Hq, T, D, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k = torch.empty(B, Hkv, S, D, dtype=torch.bfloat16, device="meta", requires_grad=True)
    v = torch.empty(B, Hkv, S, D, dtype=torch.bfloat16, device="meta", requires_grad=True)
    sinks = torch.empty(Hq, dtype=torch.float32, device="meta", requires_grad=True)
    mask = parse_mask(None, True, B, Hq, T, S, torch.device("meta"), window=16)
    out, lse = KernelAttention.apply(BACKEND, q, k, v, sinks, mask, Score(0.1))
    out.sum().backward()
    for t in (q, k, v, sinks):
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype


# --- what supports() accepts (a Call on "cuda", the platform check passed) ---

def _call(B=2, Hq=4, Hkv=2, T=16, S=16, D=64, dtype=torch.bfloat16, needs_lse=True, **kw):
    mask = parse_mask(kw.get("attn_mask"), kw.get("is_causal", False), B, Hq, T, S, torch.device("cpu"),
                      window=kw.get("window"), document_ids=kw.get("document_ids"))
    return Call("cuda", dtype, B, Hq, Hkv, T, S, D, mask, needs_lse, True)


@pytest.mark.parametrize("kw,needle", [
    ({"dtype": torch.float32}, "dtype"), ({"D": 100}, "head dim"), ({"D": 264}, "head dim"), ({"S": 0}, "empty"),
    ({"attn_mask": torch.rand(2, 1, 16, 16) > 0.5}, "dense"),
    ({"attn_mask": _keys(2, 16, [(0, 16)]) & (torch.arange(16) != 5)}, "contiguous"),
    ({"is_causal": True, "window": 4, "attn_mask": _keys(2, 16, [(0, 12)])}, "window"),
    ({"is_causal": True, "document_ids": _docs(2, 16, [[5]]), "attn_mask": _keys(2, 16, [(0, 16)])}, "documents"),
])
def test_supports_refuses_with_reason(kw, needle, monkeypatch):
    monkeypatch.setattr(cuda_flash, "_platform_reason", lambda: None)
    assert needle in BACKEND.supports(_call(**kw))


def test_dispatch_order_on_cuda(monkeypatch):
    """sdpa keeps the calls without an lse it serves; cuda_flash takes the rest before any CPU backend; flex what it
    refuses, exact only what neither takes."""
    from affine_attention.ops.backends import flex

    monkeypatch.setattr(cuda_flash, "_platform_reason", lambda: None)
    monkeypatch.setattr(flex, "_platform_reason", lambda: None)
    names = [b.name for b in BACKENDS]
    assert names.index("cuda_flash") < names.index("cpu_flash")
    assert select(_call(is_causal=True, needs_lse=False)).name == "sdpa"
    assert select(_call(is_causal=True)).name == "cuda_flash"
    assert select(_call(is_causal=True, window=3, needs_lse=False)).name == "cuda_flash"
    assert select(_call(dtype=torch.float32, is_causal=True)).name == "flex"
    assert select(_call(dtype=torch.float64, is_causal=True)).name == "exact"
    with pytest.raises(ValueError, match="cuda_flash"):
        select(_call(dtype=torch.float32), backend="cuda_flash")


def test_refused_off_cuda():
    assert "CUDA only" in BACKEND.supports(Call.of(*make_qkv(1, 2, 2, 4, 4, 8)[:2],
                                                   parse_mask(None, True, 1, 2, 4, 4, torch.device("cpu")), True))


# --- the varlen plans and layouts, numerically: the CPU model in float64 against the reference ---

def _run(op, q, k, v, extra, kw, backend=None):
    if op == "softmax":
        return (softmax_attention(q, k, v, enable_gqa=True, backend=backend, **kw),
                softmax_attention_reference(q, k, v, enable_gqa=True, **kw)[0])
    if op == "sink":
        return (sink_attention(q, k, v, extra[0], enable_gqa=True, backend=backend, **kw),
                sink_attention_reference(q, k, v, extra[0], enable_gqa=True, **kw)[0])
    return (affine_scaled_attention(q, k, v, *extra, enable_gqa=True, backend=backend, **kw),
            affine_scaled_attention_reference(q, k, v, *extra, enable_gqa=True, **kw)[0])


def _extra(op, B, Hq, T, dtype, device):
    if op == "sink":
        return (torch.randn(Hq, dtype=torch.float32, device=device).requires_grad_(),)
    if op == "affine":
        return (torch.rand(B, Hq, T, dtype=dtype, device=device).requires_grad_(),
                torch.rand(Hq, dtype=dtype, device=device))
    return ()


def _grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out)
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("op", ["softmax", "sink", "affine"])
def test_plans_against_reference_float64(op, name, shape, cpu_model):
    """Every plan (dense, documents, left/right/empty padding) gives the reference's out and gradients exactly,
    the sink's included, through the same aten argument lists the GPU gets."""
    B, Hq, Hkv, T, S = shape
    kw = _mask_kwargs(name, B, T, S)
    q, k, v = make_qkv(B, Hq, Hkv, T, S, 8)
    extra = tuple(t.double().detach().requires_grad_() for t in _extra(op, B, Hq, T, torch.float64, "cpu"))
    fast, ref = _run(op, q, k, v, extra, kw, backend="cuda_flash")
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)
    inputs = (q, k, v) + extra
    for gf, gr in zip(_grads(fast, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(gf, gr, rtol=1e-9, atol=1e-9)


def test_empty_rows_give_zero_and_neg_inf(cpu_model):
    """A query that sees no key (T > S under causal; a fully padded row): out 0, lse -inf, never the kernel's +inf."""
    q, k, v = make_qkv(2, 2, 2, 6, 4, 8, requires_grad=False)
    for kw in ({"is_causal": True}, {"attn_mask": _keys(2, 4, [(1, 4), (0, 0)])}):
        mask = parse_mask(kw.get("attn_mask"), kw.get("is_causal", False), 2, 2, 6, 4, torch.device("cpu"))
        out, lse = BACKEND.forward(q, k, v, mask, Score(0.3))
        empty = ~mask.dense_bool(q.device).expand(2, 2, 6, 4).any(-1)
        assert empty.any() and torch.isneginf(lse[empty]).all() and torch.isfinite(lse[~empty]).all()
        assert (out[empty] == 0).all()


def test_lse_term_guard_would_fail(cpu_model):
    """The sink gradient of every lse backend matches the reference on dq and dk, and a sink built on a raw,
    gradient-free lse is far enough off that this comparison would catch it."""
    B, Hq, Hkv, T, S = 2, 4, 2, 9, 13
    q, k, v = make_qkv(B, Hq, Hkv, T, S, 8)
    # Sinks near the rows' lse (gates near 1/2), where the lse term carries the most gradient.
    sinks = (2.0 + 0.1 * torch.randn(Hq, dtype=torch.float64)).requires_grad_()
    ref = sink_attention_reference(q, k, v, sinks, is_causal=True, enable_gqa=True)[0]
    want = _grads(ref, (q, k))
    for b in BACKENDS:
        if not b.has_lse:
            continue
        got = _grads(sink_attention(q, k, v, sinks, is_causal=True, enable_gqa=True, backend=b.name), (q, k))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=f"backend {b.name}")
    mask = parse_mask(None, True, B, Hq, T, S, q.device)
    out, lse = KernelAttention.apply(BACKEND, q, k, v, None, mask, Score(q.shape[-1] ** -0.5))
    naive = out * torch.sigmoid(lse - sinks[None, :, None])[..., None]  # lse carries no gradient
    for g, w in zip(_grads(naive, (q, k)), want):
        assert (g - w).abs().max() > 0.1 * w.abs().max()


# --- the real kernel (a lent GPU): bf16 against the float64 reference ---

requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# (B, Hq, Hkv, T, S, D): T % 128 == 64, GQA 4:1, T < S, T > S, one decoding query.
CUDA_SHAPES = [(2, 8, 2, 192, 192, 128), (1, 4, 4, 320, 320, 64), (2, 4, 1, 100, 257, 128),
               (2, 4, 2, 130, 70, 128), (2, 8, 2, 1, 300, 128)]


def assert_low_precision_close(fast, plain, ref, label, factor=3.0):
    """The kernel's error against float64 within `factor` times that of the reference evaluated in the low
    dtype itself (as flash-attn's own tests): calibrated, yet a misplaced mask or a lost term is far outside."""
    err = (fast.double() - ref).abs().max().item()
    base = (plain.double() - ref).abs().max().item()
    assert err <= factor * base + 1e-4 * ref.abs().max().item(), f"{label}: error {err:.3g}, bf16 reference {base:.3g}"


def _inputs(shape, op, dtype, device):
    """The kernel's inputs (low precision; sinks and alpha float32), the reference's in the low dtype and in
    float64 (the same values, upcast)."""
    B, Hq, Hkv, T, S, D = shape
    low = [torch.randn(*s, device=device, dtype=dtype) for s in ((B, Hq, T, D), (B, Hkv, S, D), (B, Hkv, S, D))]
    extra = _extra(op, B, Hq, T, torch.float32, device)
    high = [t.double().requires_grad_() for t in low] + [t.detach().double().requires_grad_(t.requires_grad)
                                                         for t in extra]
    plain = [t.detach().clone().requires_grad_() for t in low] + [t.detach().to(dtype).requires_grad_(
        t.requires_grad) for t in extra]
    return [t.requires_grad_() for t in low] + list(extra), plain, high


def check_low_precision(op, name, shape, device, dtype=torch.bfloat16):
    """cuda_flash in `dtype` against the float64 reference on out and every gradient (see the tolerance above)."""
    torch.manual_seed(0)
    B, Hq, Hkv, T, S, D = shape
    kw = {key: (val.to(device) if torch.is_tensor(val) else val) for key, val in _mask_kwargs(name, B, T, S).items()}
    fast_in, plain_in, high_in = _inputs(shape, op, dtype, device)
    fast = _run(op, *fast_in[:3], tuple(fast_in[3:]), kw, backend="cuda_flash")[0]
    plain = _run(op, *plain_in[:3], tuple(plain_in[3:]), kw)[1]
    ref = _run(op, *high_in[:3], tuple(high_in[3:]), kw)[1]
    assert fast.dtype == dtype and fast.shape == ref.shape
    assert_low_precision_close(fast, plain, ref, "out")
    g = torch.randn_like(ref)
    labels = ["dq", "dk", "dv", {"sink": "dsinks", "affine": "dalpha"}.get(op)]
    grads = [torch.autograd.grad(o, [t for t in ins if t.requires_grad], g.to(o.dtype))
             for o, ins in ((fast, fast_in), (plain, plain_in), (ref, high_in))]
    assert len(grads[0]) == len(grads[2]) == (3 if op == "softmax" else 4)
    for label, a, b, c in zip(labels, *grads):
        assert_low_precision_close(a, b, c, label)


@pytest.mark.parametrize("name", ["causal", "right_pad", "documents"])
@pytest.mark.parametrize("op", ["softmax", "sink", "affine"])
def test_low_precision_check_on_the_cpu_model(op, name, cpu_model):
    """The GPU test's own code, run here through the CPU model in bf16, so that it runs the first time there."""
    check_low_precision(op, name, (2, 4, 2, 40, 48, 16), "cpu")


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("op", ["softmax", "sink", "affine"])
def test_cuda_kernel_against_float64_reference(op, name, shape):
    check_low_precision(op, name, shape, "cuda")


@pytest.mark.cuda
@requires_cuda
def test_cuda_empty_rows_and_lse_guard():
    """On the real kernel: empty rows give out 0 / lse -inf, and the sink's dq, dk keep the lse term."""
    q, k, v = (torch.randn(2, 4, t, 64, device="cuda", dtype=torch.bfloat16) for t in (96, 64, 64))
    mask = parse_mask(None, True, 2, 4, 96, 64, q.device)
    out, lse = BACKEND.forward(q, k, v, mask, Score(0.125))
    assert (out[:, :, :32] == 0).all() and torch.isneginf(lse[:, :, :32]).all()
    assert torch.isfinite(lse[:, :, 32:]).all()
    low = [t[:, :, :64].detach().requires_grad_() for t in (q, k, v)]
    plain = [t.detach().clone().requires_grad_() for t in low]
    high = [t.detach().double().requires_grad_() for t in low]
    sinks = torch.randn(4, device="cuda")
    outs = (sink_attention(*low, sinks, is_causal=True, backend="cuda_flash"),
            sink_attention_reference(*plain, sinks.bfloat16(), is_causal=True)[0],
            sink_attention_reference(*high, sinks.double(), is_causal=True)[0])
    g = torch.randn_like(outs[2])
    grads = [torch.autograd.grad(o, ins[:2], g.to(o.dtype)) for o, ins in zip(outs, (low, plain, high))]
    for label, a, b, c in zip(("dq", "dk"), *grads):
        assert_low_precision_close(a, b, c, label)


def test_plan_is_derived_once_per_mask_object():
    """Every layer of a forward shares one MaskSpec (built at the seam): its varlen parts are derived once on it;
    another mask object (the next forward) plans again, so a mask changed in place between forwards is replanned."""
    keys = _keys(2, 16, [(3, 16)])
    mask = parse_mask(keys, True, 2, 4, 16, 16, torch.device("cpu"))
    first = cuda_flash.kernel_parts(mask, 2, 4, 2)
    assert cuda_flash.kernel_parts(mask, 2, 4, 2) is first
    keys[1, ..., 5] = False  # row 1 no longer contiguous
    assert "contiguous" in cuda_flash.reason(parse_mask(keys, True, 2, 4, 16, 16, torch.device("cpu")), 2)
    with torch.inference_mode():
        docs = _docs(2, 16, [[4]])
        parts = cuda_flash.kernel_parts(parse_mask(None, True, 2, 4, 16, 16, torch.device("cpu"), document_ids=docs), 2, 4, 2)
    assert parts[0].cu_q.tolist() == [0, 4, 16, 20, 32]
