"""Sliding windows and packed documents in MaskSpec: validation, key ranges, and the affine mean of V as centred
float32 prefix sums (exact in float64, no drift with S in float32)."""
import pytest
import torch

from affine_attention.ops import affine_scaled_attention, softmax_attention
from affine_attention.ops.masks import parse_mask
from affine_attention.ops.visible_sums import visible_sum_and_count


def _docs(B, S, n=4):
    return torch.sort(torch.randint(0, n, (B, S)), dim=1).values


def _dense_sum_and_count(v, mask):
    vis = mask.dense_bool(v.device).to(v.dtype)  # (B|1, 1, T, S)
    return vis @ v, vis.sum(-1, keepdim=True)


CASES = [  # (B, T, S, causal, window, documents, padding)
    (2, 37, 37, True, 5, None, None), (2, 37, 37, True, 1, None, "left"), (2, 37, 37, True, 40, None, None),
    (2, 5, 13, True, 4, None, "right"), (2, 13, 5, True, 3, None, None), (1, 1, 19, True, 7, None, None),
    (2, 37, 37, True, None, "per_row", None), (2, 37, 37, False, None, "per_row", "left"),
    (2, 9, 30, True, None, "shared", "right"), (2, 37, 37, True, 6, "per_row", "left"),
    (2, 37, 37, True, None, "one_token", None), (1, 64, 64, True, 16, "one_token", None),
]


@pytest.mark.parametrize("B, T, S, causal, window, docs, pad", CASES)
def test_visible_sum_and_count_equals_the_dense_mask(B, T, S, causal, window, docs, pad):
    v = torch.randn(B, 2, S, 4, dtype=torch.float64) + 3.0
    ids = None
    if docs == "per_row":
        ids = _docs(B, S)
    elif docs == "shared":
        ids = _docs(1, S)
    elif docs == "one_token":
        ids = torch.arange(S)[None]
    attn_mask = None
    if pad is not None:
        attn_mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
        attn_mask[0, ..., :3] = False
        if pad == "right":
            attn_mask[-1, ..., S - 2:] = False
    mask = parse_mask(attn_mask, causal, B, 2, T, S, v.device, window=window, document_ids=ids)
    total, count = visible_sum_and_count(v, mask, 2)
    want_total, want_count = _dense_sum_and_count(v, mask)
    torch.testing.assert_close(total.expand_as(want_total), want_total, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(count.expand_as(want_count), want_count, rtol=0, atol=0)


@pytest.mark.parametrize("B, T, S, causal, window, docs, pad", CASES)
def test_key_ranges_bound_the_visible_keys(B, T, S, causal, window, docs, pad):
    ids = None if docs is None else (_docs(B, S) if docs != "one_token" else torch.arange(S)[None])
    mask = parse_mask(None, causal, B, 1, T, S, torch.device("cpu"), window=window, document_ids=ids)
    lo, hi = mask.key_ranges(torch.device("cpu"))
    vis = mask.dense_bool(torch.device("cpu"))[:, 0]  # (B|1, T, S)
    j = torch.arange(S)
    inside = (j >= lo[..., None]) & (j < hi[..., None])
    assert torch.equal(inside.expand_as(vis), vis.expand_as(inside))
    # The shape-only band of any block contains every key its queries may see.
    for start in range(0, T, 8):
        stop = min(T, start + 8)
        b_lo, b_hi = mask.static_key_range(start, stop)
        seen = hi[:, start:stop] > lo[:, start:stop]  # queries that see at least one key
        assert (lo[:, start:stop][seen] >= b_lo).all() and (hi[:, start:stop][seen] <= b_hi).all()


def test_chunk_bool_over_a_key_range_is_a_slice_of_the_full_mask():
    ids = _docs(2, 30)
    pad = torch.rand(2, 1, 1, 30) > 0.2
    mask = parse_mask(pad, True, 2, 1, 30, 30, torch.device("cpu"), window=7, document_ids=ids)
    full = mask.chunk_bool(5, 20, torch.device("cpu"))
    assert torch.equal(mask.chunk_bool(5, 20, torch.device("cpu"), 3, 17), full[..., 3:17])


def _uncentred_mean(v, mask):
    """The naive form: one float32 prefix sum over all of S, differenced at each query's range."""
    lo, hi = mask.key_ranges(v.device)
    c = torch.cat([v.new_zeros(*v.shape[:2], 1, v.shape[3]), v.cumsum(2)], dim=2)
    take = lambda i: c[:, :, i[0]]  # noqa: E731  (B = 1, shared ids)
    return (take(hi) - take(lo)) / (hi - lo)[0, None, :, None].clamp(min=1)


@pytest.mark.parametrize("window, docs", [(256, None), (None, 16), (256, 16)])
def test_float32_mean_does_not_drift_with_length(window, docs):
    """At S = 32768 with a large common offset in V (real values have one), the centred float32 mean stays
    within 1e-6 of float64 relative to the offset; the uncentred prefix difference is far off (so the check can
    fail)."""
    S = 32768
    v = torch.randn(1, 1, S, 4, dtype=torch.float64) + 100.0
    ids = None if docs is None else (torch.arange(S) // (S // docs))[None]
    mask = parse_mask(None, True, 1, 1, S, S, v.device, window=window, document_ids=ids)
    total64, count64 = visible_sum_and_count(v, mask, 1)
    mean64 = total64 / count64
    total32, count32 = visible_sum_and_count(v.float(), mask, 1)
    err = ((total32 / count32).double() - mean64).abs().max().item()
    naive = (_uncentred_mean(v.float(), mask).double() - mean64).abs().max().item()
    assert err < 1e-6 * 100.0, err
    assert naive > 10 * err, (naive, err)


def test_affine_under_window_and_documents_matches_softmax_plus_the_mean():
    """alpha = 0 leaves only the mean of the visible values: the window's and documents' N_i show directly."""
    B, H, T = 1, 2, 20
    q, k, v = (torch.randn(B, H, T, 4, dtype=torch.float64) for _ in range(3))
    ids = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4])
    out = affine_scaled_attention(q, k, v, torch.zeros(B, H, T, dtype=q.dtype), torch.ones(H, dtype=q.dtype),
                                  is_causal=True, window=3, document_ids=ids)
    for i in range(T):
        j0 = max(i - 2, {0: 0, 1: 7, 2: 16}[int(ids[0, i])])
        torch.testing.assert_close(out[:, :, i], v[:, :, j0:i + 1].mean(2))


@pytest.mark.parametrize("kw, match", [
    (dict(window=0, is_causal=True), r"window must be a positive int"),
    (dict(window=-2, is_causal=True), r"window must be a positive int"),
    (dict(window=2.5, is_causal=True), r"window must be a positive int"),
    (dict(window=True, is_causal=True), r"window must be a positive int"),
    (dict(window=3), r"window needs is_causal=True"),
    (dict(document_ids=[[0, 0, 1, 1, 2]]), r"document_ids must be an integer tensor of shape \(B, S\)"),
    (dict(document_ids=torch.zeros(1, 5)), r"document_ids must be an integer tensor .* got dtype torch.float32"),
    (dict(document_ids=torch.zeros(1, 5, dtype=torch.bool)), r"got dtype torch.bool"),
    (dict(document_ids=torch.zeros(5, dtype=torch.long)), r"document_ids must have shape \(B, S\) = \(2, 5\)"),
    (dict(document_ids=torch.zeros(3, 5, dtype=torch.long)), r"document_ids must have shape \(B, S\)"),
    (dict(document_ids=torch.zeros(2, 4, dtype=torch.long)), r"document_ids must have shape \(B, S\)"),
    (dict(document_ids=torch.tensor([[0, 1, 1, 0, 2]])), r"document_ids must be non-decreasing"),
])
def test_bad_window_or_document_ids_raise(kw, match):
    q = torch.randn(2, 2, 5, 4)
    with pytest.raises(ValueError, match=match):
        softmax_attention(q, q, q, **kw)


def test_documents_need_t_at_most_s():
    q, k = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 4, 4)
    with pytest.raises(ValueError, match=r"document_ids needs T <= S"):
        softmax_attention(q, k, k, document_ids=torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_document_ids_are_checked_at_every_parse(dtype, monkeypatch):
    """The non-decreasing check (a host sync) runs whenever a mask is parsed: once per op call, or once per model
    forward at the seam (which parses once for every layer); there is no memo keyed by tensor identity that an
    in-place write to the ids (or to the tensor they view) could leave stale."""
    calls = []
    check = torch.Tensor.any
    monkeypatch.setattr(torch.Tensor, "any", lambda self, *a, **k: calls.append(1) or check(self, *a, **k))
    whole = torch.tensor([[0, 0, 1, 1, 2, 9], [0, 1, 1, 1, 1, 9]], dtype=dtype)
    ids = whole[:, :5]  # a view, as a caller's slice of a packed buffer
    parse = lambda: parse_mask(None, True, 2, 2, 5, 5, torch.device("cpu"), document_ids=ids).documents
    first = parse()
    assert first.dtype == torch.int64 and torch.equal(first, ids.long()) and len(calls) == 1
    whole[0, 3] = 0  # through the base: row 0 is now 0, 0, 1, 0, 2
    with pytest.raises(ValueError, match="non-decreasing"):
        parse()
    assert len(calls) == 2


def test_key_mask_of_one_column_counts_every_key():
    """A (B, 1, 1, 1) key mask broadcasts over S: N_i counts S keys, not 1."""
    v = torch.randn(2, 1, 6, 3, dtype=torch.float64)
    mask = parse_mask(torch.ones(2, 1, 1, 1, dtype=torch.bool), False, 2, 1, 6, 6, v.device)
    total, count = visible_sum_and_count(v, mask, 1)
    assert torch.all(count == 6)
    torch.testing.assert_close(total / count, v.mean(2, keepdim=True))


@pytest.mark.slow
def test_structured_masks_compile_with_fullgraph():
    """torch.compile(fullgraph=True) traces window, documents and padding on the CPU fast path (no host sync, no
    graph break) and gives the eager result."""
    from affine_attention.ops import sink_attention

    T = 300
    q, k, v = (torch.randn(1, h, T, 16, requires_grad=True) for h in (2, 1, 1))
    alpha, alpha_ma, sinks = torch.rand(1, 2, T, requires_grad=True), torch.rand(2), torch.zeros(2, requires_grad=True)
    pad = torch.ones(1, 1, 1, T, dtype=torch.bool)
    pad[..., :5] = False
    kw = dict(is_causal=True, window=64, document_ids=(torch.arange(T) * 3 // T)[None], attn_mask=pad,
              enable_gqa=True)
    for f in (lambda: affine_scaled_attention(q, k, v, alpha, alpha_ma, **kw),
              lambda: sink_attention(q, k, v, sinks, **kw)):
        out = torch.compile(f, fullgraph=True)()
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        want = f()
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads, torch.autograd.grad(want.sum(), (q, k, v))):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
