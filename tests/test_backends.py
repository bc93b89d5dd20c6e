"""Every kernel backend x op x mask against the float64 reference (outputs and every gradient), forced-backend
errors, the dispatcher's choice, and a guard that the sink's gradient keeps its log-sum-exp term."""
import re

import pytest
import torch

from affine_attention.ops import (
    affine_scaled_attention, affine_scaled_attention_reference, off_by_one_attention, sink_attention,
    sink_attention_reference, softmax_attention, softmax_attention_reference, visible_mask,
)
from affine_attention.ops.backends import BACKENDS, Call, backend_names, get_backend, select, use_backend
from affine_attention.ops.backends import cpu_flash
from affine_attention.ops.call import Score
from affine_attention.ops.masks import parse_mask
from affine_attention.ops.reference import attention_logits
from affine_attention.variants import AttentionShape, build_variant, variant_names
from conftest import make_qkv

# (B, Hq, Hkv, T, S): GQA, T < S (after a cache), T = 1 (decoding), T not a multiple of the block size (16 below).
SHAPES = [(2, 4, 2, 37, 37), (2, 2, 1, 5, 13), (1, 2, 2, 1, 19), (2, 2, 1, 45, 29)]
MASKS = ["none", "causal", "pad_left", "pad_right", "window", "window_ge_S", "window1", "docs", "docs_shared",
         "docs_one_token", "docs_window_pad", "docs_full", "dense"]
OPS = ["softmax", "sink", "off_by_one", "affine", "affine_full"]
REAL_BLOCK = cpu_flash.BLOCK


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """Blocks of 16 queries, so these small shapes span several blocks of the banded CPU path."""
    monkeypatch.setattr(cpu_flash, "BLOCK", 16)


def _documents(B, S, one_token=False):
    """(B, S) non-decreasing ids: random document lengths per row (or one token each, with one longer run)."""
    if one_token:
        ids = torch.arange(S)
        ids[S // 2:S // 2 + 4] = S // 2
        return ids[None].expand(B, S).contiguous()
    return torch.sort(torch.randint(0, 4, (B, S)), dim=1).values


def mask_kwargs(kind, B, T, S):
    """The op keywords for one mask kind (None where the kind does not apply to this shape)."""
    pad = torch.ones(B, 1, 1, S, dtype=torch.bool)
    if kind == "none":
        return {}
    if kind == "causal":
        return dict(is_causal=True)
    if kind == "pad_left":
        pad[0, ..., :3] = False
        return dict(is_causal=True, attn_mask=pad)
    if kind == "pad_right":
        pad[-1, ..., S - 2:] = False
        return dict(is_causal=True, attn_mask=pad)
    if kind == "window":
        return dict(is_causal=True, window=5)
    if kind == "window_ge_S":
        return dict(is_causal=True, window=S + 3)
    if kind == "window1":
        return dict(is_causal=True, window=1)
    if kind == "dense":
        return dict(is_causal=True, attn_mask=torch.rand(B, 1, T, S) > 0.3)
    if T > S:
        return None  # documents: queries are the last T of the S positions
    if kind == "docs":  # a layout per row
        return dict(is_causal=True, document_ids=_documents(B, S))
    if kind == "docs_shared":  # one layout for every row, ids of shape (1, S)
        return dict(is_causal=True, document_ids=_documents(1, S))
    if kind == "docs_one_token":
        return dict(is_causal=True, document_ids=_documents(1, S, one_token=True))
    if kind == "docs_window_pad":
        pad[0, ..., :3] = False
        return dict(is_causal=True, window=4, document_ids=_documents(B, S), attn_mask=pad)
    return dict(document_ids=_documents(B, S))  # docs_full: bidirectional inside each document


def _extra(op, B, Hq, T):
    if op.startswith("affine"):
        return (torch.rand(B, Hq, T, dtype=torch.float64, requires_grad=True), torch.rand(Hq, dtype=torch.float64))
    if op == "sink":
        return (torch.randn(Hq, dtype=torch.float64, requires_grad=True) * 2,)
    return ()


def run_op(op, q, k, v, extra, kw, backend=None):
    """(fast output through `backend`, float64 reference output) for one op."""
    kw = dict(kw, enable_gqa=q.shape[1] != k.shape[1])
    if op.startswith("affine"):
        bn = "full" if op == "affine_full" else "visible"
        return (affine_scaled_attention(q, k, v, *extra, bias_norm=bn, backend=backend, **kw),
                affine_scaled_attention_reference(q, k, v, *extra, bias_norm=bn, **kw)[0])
    if op == "sink":
        return (sink_attention(q, k, v, *extra, backend=backend, **kw),
                sink_attention_reference(q, k, v, *extra, **kw)[0])
    if op == "off_by_one":
        zeros = torch.zeros(q.shape[1], dtype=q.dtype)
        return off_by_one_attention(q, k, v, backend=backend, **kw), sink_attention_reference(q, k, v, zeros, **kw)[0]
    return softmax_attention(q, k, v, backend=backend, **kw), softmax_attention_reference(q, k, v, **kw)[0]


def _call(op, q, k, kw):
    """The Call the dispatcher sees for this op and mask."""
    B, Hq, T, _ = q.shape
    mask = parse_mask(kw.get("attn_mask"), kw.get("is_causal", False), B, Hq, T, k.shape[2], q.device,
                      window=kw.get("window"), document_ids=kw.get("document_ids"))
    return Call.of(q, k, mask, needs_lse=op in ("sink", "off_by_one"))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", backend_names())
def test_backend_matches_float64_reference(backend, op, mask, shape):
    B, Hq, Hkv, T, S = shape
    kw = mask_kwargs(mask, B, T, S)
    if kw is None:
        pytest.skip("documents need T <= S")
    q, k, v = make_qkv(B, Hq, Hkv, T, S, 8)
    extra = _extra(op, B, Hq, T)
    reason = get_backend(backend).supports(_call(op, q, k, kw))
    if reason is not None:
        with pytest.raises(ValueError, match=re.escape(f"attention backend {backend!r} cannot serve this call: "
                                                       f"{reason}")):
            run_op(op, q, k, v, extra, kw, backend=backend)
        return
    fast, ref = run_op(op, q, k, v, extra, kw, backend=backend)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)
    inputs = [q, k, v] + [x for x in extra if x.requires_grad]
    g = torch.randn_like(fast)
    for gf, gr in zip(torch.autograd.grad(fast, inputs, g), torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(gf, gr, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask", ["causal", "pad_left", "window", "docs", "docs_shared", "docs_window_pad",
                                  "docs_full"])
def test_cpu_flash_and_exact_serve_every_structured_cpu_mask(mask):
    """So the matrix above really runs the fast CPU path on windows and documents instead of skipping them."""
    q, k, _ = make_qkv(2, 4, 2, 37, 37, 8)
    kw = mask_kwargs(mask, 2, 37, 37)
    for op in OPS:
        assert get_backend("cpu_flash").supports(_call(op, q, k, kw)) is None
        assert get_backend("exact").supports(_call(op, q, k, kw)) is None


@pytest.mark.parametrize("layout, window", [("per_row", 100), ("shared", 150), ("shared", 40), ("shared", None)])
def test_banded_path_at_the_real_block_size(monkeypatch, layout, window):
    """T = 300 spans three real blocks with a ragged last one; documents (per row, or shared documents of 100
    keys) with padding, and a window that cuts inside the documents or not."""
    monkeypatch.setattr(cpu_flash, "BLOCK", REAL_BLOCK)
    B, Hq, Hkv, T = 2, 2, 1, 300
    q, k, v = make_qkv(B, Hq, Hkv, T, T, 8)
    kw = mask_kwargs("docs_window_pad", B, T, T)
    kw["window"] = window
    if layout == "shared":
        kw["document_ids"] = (torch.arange(T) * 3 // T)[None]
    for op in ("sink", "affine"):
        extra = _extra(op, B, Hq, T)
        fast, ref = run_op(op, q, k, v, extra, kw, backend="cpu_flash")
        torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)
        inputs = [q, k, v] + [x for x in extra if x.requires_grad]
        g = torch.randn_like(fast)
        for gf, gr in zip(torch.autograd.grad(fast, inputs, g), torch.autograd.grad(ref, inputs, g)):
            torch.testing.assert_close(gf, gr, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask, T", [("pad_left", 21), ("window", 21), ("docs_window_pad", 17), ("dense", 21)])
@pytest.mark.parametrize("backend", [b.name for b in BACKENDS if b.has_lse])
def test_raw_forward_lse_is_the_log_sum_exp(backend, mask, T):
    """lse: (B, Hq, T) of the visible logits, -inf for a query that sees no key (T > S and padding give some)."""
    B, Hq, Hkv, S = 2, 4, 2, 17
    q, k, v = make_qkv(B, Hq, Hkv, T, S, 8, requires_grad=False)
    kw = mask_kwargs(mask, B, T, S)
    call = _call("sink", q, k, kw)
    b = get_backend(backend)
    if b.supports(call) is not None:
        pytest.skip(f"{backend}: {b.supports(call)}")
    out, lse = b.forward(q, k, v, call.mask, Score(0.3))
    vis = visible_mask(kw.get("attn_mask"), kw.get("is_causal", False), T, S, q.device, window=kw.get("window"),
                       document_ids=kw.get("document_ids"))
    want = attention_logits(q, k, scale=0.3, enable_gqa=True).masked_fill(~vis, float("-inf")).logsumexp(-1)
    assert torch.isinf(want).any()
    torch.testing.assert_close(lse, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask", ["causal", "pad_left", "window", "docs"])
@pytest.mark.parametrize("backend", [b.name for b in BACKENDS if b.has_lse])
def test_sink_gradient_keeps_the_lse_term(backend, mask):
    """dq and dk of the sink depend on d lse / dq: a sink treated as a constant gate on softmax drops that term.
    The dropped form must be visibly wrong here (so this check can fail) while the backend's form is exact."""
    B, Hq, Hkv, T = 2, 2, 1, 23
    q, k, v = make_qkv(B, Hq, Hkv, T, T, 8)
    kw = dict(mask_kwargs(mask, B, T, T), enable_gqa=True)
    if get_backend(backend).supports(_call("sink", q, k, kw)) is not None:
        pytest.skip("backend does not serve this mask")
    sinks = torch.full((Hq,), 0.5, dtype=torch.float64)  # comparable to the logits: the gate is far from 0 and 1
    g = torch.randn(B, Hq, T, 8, dtype=torch.float64)
    ref = sink_attention_reference(q, k, v, sinks, **kw)[0]
    want = torch.autograd.grad(ref, (q, k), g)
    got = torch.autograd.grad(sink_attention(q, k, v, sinks, backend=backend, **kw), (q, k), g)
    vis = visible_mask(kw.get("attn_mask"), kw.get("is_causal", False), T, T, q.device, window=kw.get("window"),
                       document_ids=kw.get("document_ids"))
    lse = attention_logits(q, k, enable_gqa=True).masked_fill(~vis, float("-inf")).logsumexp(-1)
    gate = torch.sigmoid(lse - sinks[None, :, None]).detach()
    dropped = torch.autograd.grad(softmax_attention(q, k, v, backend=backend, **kw) * gate[..., None], (q, k), g)
    for w, a, d in zip(want, got, dropped):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10)
        assert (d - w).abs().max() > 1e-2 * w.abs().max()


def test_forced_backend_that_cannot_serve_raises_naming_what_it_lacks():
    q, k, v = make_qkv(1, 2, 2, 6, 6, 8)
    sinks = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'sdpa' cannot serve this call: SDPA returns no log-sum-exp"):
        sink_attention(q, k, v, sinks, is_causal=True, backend="sdpa")
    with pytest.raises(ValueError, match=r"'sdpa' cannot serve this call: masks \['window'\]"):
        softmax_attention(q, k, v, is_causal=True, window=2, backend="sdpa")
    with pytest.raises(ValueError, match=r"'cpu_flash' cannot serve this call: masks \['dense'\]"):
        softmax_attention(q, k, v, attn_mask=torch.rand(1, 1, 6, 6) > 0.5, backend="cpu_flash")
    with pytest.raises(ValueError, match=r"'cpu_flash' cannot serve this call: runs on CPU only \(got meta\)"):
        softmax_attention(*(t.detach().to("meta") for t in (q, k, v)), is_causal=True, backend="cpu_flash")
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash3'; choose one of"):
        softmax_attention(q, k, v, backend="flash3")


def test_use_backend_forces_every_op_in_the_block_and_restores():
    q, k, v = make_qkv(1, 2, 2, 6, 6, 8, requires_grad=False)
    mask = parse_mask(None, True, 1, 2, 6, 6, q.device)
    call = Call.of(q, k, mask, needs_lse=False)
    assert select(call).name == "sdpa"
    with use_backend("exact"):
        assert select(call).name == "exact"
        assert select(call, "cpu_flash").name == "cpu_flash"  # backend= on the op wins over the block
        with use_backend(None):
            assert select(call).name == "sdpa"
        assert select(call).name == "exact"
    assert select(call).name == "sdpa"
    with use_backend("sdpa"):
        with pytest.raises(ValueError, match=r"'sdpa' cannot serve this call: SDPA returns no log-sum-exp"):
            sink_attention(q, k, v, torch.zeros(2, dtype=q.dtype), is_causal=True)
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'"):
        with use_backend("nope"):
            pass


@pytest.mark.parametrize("mask, needs_lse, want", [
    ("causal", False, "sdpa"), ("causal", True, "cpu_flash"), ("pad_left", False, "cpu_flash"),
    ("window", False, "cpu_flash"), ("docs", True, "cpu_flash"), ("dense", False, "exact"),
])
def test_automatic_choice_on_cpu(mask, needs_lse, want):
    q, k, _ = make_qkv(2, 4, 2, 37, 37, 8, requires_grad=False)
    call = _call("sink" if needs_lse else "softmax", q, k, mask_kwargs(mask, 2, 37, 37))
    assert select(call).name == want


def test_chunked_prefill_after_cache_uses_the_banded_path():
    """1 < T < S causal: blocks of queries, the same result as the exact backend."""
    q, k, v = make_qkv(1, 2, 2, 40, 100, 8)
    sinks = torch.randn(2, dtype=torch.float64)
    a = sink_attention(q, k, v, sinks, is_causal=True, backend="cpu_flash")
    b = sink_attention(q, k, v, sinks, is_causal=True, backend="exact")
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", variant_names())
@pytest.mark.parametrize("backend", ["cpu_flash", "exact"])
def test_variants_pass_window_and_documents_through(name, backend):
    shape = AttentionShape(hidden_size=24, num_heads=4, num_kv_heads=2, head_dim=8)
    m = build_variant(name, shape).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        if hasattr(m, "alpha_ma"):
            m.alpha_ma.copy_(torch.rand_like(m.alpha_ma))
    m.eval()
    B, T = 2, 37
    q, k, v = make_qkv(B, 4, 2, T, T, 8)
    x = torch.randn(B, T, 24, dtype=torch.float64, requires_grad=True)
    kw = dict(is_causal=True, window=6, document_ids=_documents(B, T))
    out = m(q, k, v, x, backend=backend, **kw)
    ref = m.reference(q, k, v, x, **kw)[0]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    inputs = [q, k, v, x] + list(m.parameters())
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, inputs, g, allow_unused=True),
                    torch.autograd.grad(ref, inputs, g, allow_unused=True)):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_each_backend_file_registers_one_backend_in_its_declared_priority_order():
    """One file in ops/backends = one backend, found without a list to edit; the automatic choice asks them by their
    declared priority, and a clash in name or priority is refused (the order between them would be arbitrary)."""
    import pkgutil

    from affine_attention.ops import backends
    from affine_attention.ops.backends.base import REGISTRY, Backend, register

    files = {m.name for m in pkgutil.iter_modules(backends.__path__)} - {"base"}
    assert set(backend_names()) == files
    assert [b.priority for b in BACKENDS] == sorted((b.priority for b in BACKENDS), reverse=True)
    assert backend_names()[-1] == "exact"  # the fallback that serves any call is asked last

    class Clash(Backend):
        name, priority = "clash", BACKENDS[0].priority

    with pytest.raises(ValueError, match="names and priorities must be unique"):
        register(Clash)

    class First(Backend):
        name, priority, has_lse = "first_test_backend", max(b.priority for b in BACKENDS) + 1, False

        def supports(self, call):
            return None

        def attention(self, q, k, v, mask, score):
            return torch.zeros_like(q)

    register(First)
    try:
        assert backend_names()[0] == "first_test_backend"
        q = torch.randn(1, 1, 3, 4)
        assert torch.equal(softmax_attention(q, q, q), torch.zeros_like(q))  # the highest priority serves it
    finally:
        REGISTRY.remove(next(b for b in REGISTRY if b.name == "first_test_backend"))
    assert "first_test_backend" not in backend_names()
