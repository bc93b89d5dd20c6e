"""The sums of visible values under sliding windows and packed documents (ops/visible_sums.py, through
visible_sums.visible_sum_and_count and the public op): right values, no trace of a hidden key even in rounding, a number
of torch ops that does not grow with the batch, and torch.compile(fullgraph=True)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from affine_attention.ops import affine_scaled_attention
from affine_attention.ops.masks import parse_mask
from affine_attention.ops.visible_sums import visible_sum_and_count
from affine_attention.ops.reference import visible_mask


def _ids(kind, B, S):
    """(B|1, S) non-decreasing document ids, or None."""
    if kind is None:
        return None
    if kind == "rows":  # a different layout in every row
        return torch.sort(torch.randint(0, 4, (B, S)), dim=1).values
    if kind == "shared":
        return torch.sort(torch.randint(0, 3, (1, S)), dim=1).values
    if kind == "singletons":  # every document one token long
        return torch.arange(S)[None]
    if kind == "short":  # a document of length 1 between two longer ones, shifted in every row
        rows = [[0] * (S // 2 + b) + [1] + [2] * (S - S // 2 - b - 1) for b in range(B)]
        return torch.tensor(rows)
    raise AssertionError(kind)


def _pad(kind, B, S):
    """(B, 1, 1, S) bool key mask (True = may attend), or None."""
    if kind is None:
        return None
    m = torch.ones(B, 1, 1, S, dtype=torch.bool)
    if kind == "left":
        m[0, ..., :3] = False
    elif kind == "right":
        m[-1, ..., S - 4:] = False
    elif kind == "random":
        m = torch.rand(B, 1, 1, S) > 0.3
    return m


CASES = [  # (B, Hq, Hkv, T, S, causal, window, documents, padding)
    (2, 2, 2, 37, 37, True, 5, None, None),  # T not a multiple of the window
    (3, 4, 2, 37, 37, True, 7, None, "random"),  # GQA, padding with a window
    (2, 2, 1, 9, 30, True, 4, None, "left"),  # queries after a cache
    (2, 2, 2, 37, 37, True, 1, None, "right"),  # a window of one key
    (2, 2, 2, 20, 20, True, 20, "rows", None),  # window >= S: documents alone
    (2, 2, 2, 13, 5, True, 3, None, None),  # T > S: the first queries see nothing
    (1, 1, 1, 1, 19, True, 7, None, None),  # one decoding step
    (3, 2, 2, 37, 37, True, None, "rows", None),
    (3, 2, 2, 37, 37, False, None, "rows", "left"),  # documents without causal
    (2, 4, 2, 9, 30, True, None, "shared", "right"),
    (3, 2, 1, 37, 37, True, 6, "rows", "random"),
    (2, 2, 2, 11, 40, True, 5, "rows", None),
    (2, 2, 2, 25, 25, True, None, "singletons", None),
    (1, 2, 2, 64, 64, True, 16, "singletons", None),
    (3, 2, 2, 33, 33, True, 4, "short", "left"),
    (2, 2, 2, 33, 33, True, None, "short", None),
]


def _case(B, Hq, Hkv, T, S, causal, window, docs, pad, dtype=torch.float64):
    v = (torch.randn(B, Hkv, S, 5) + 3.0).to(dtype)
    ids, attn_mask = _ids(docs, B, S), _pad(pad, B, S)
    mask = parse_mask(attn_mask, causal, B, Hq, T, S, v.device, window=window, document_ids=ids)
    vis = visible_mask(attn_mask, causal, T, S, v.device, window=window, document_ids=ids)  # (B|1, 1, T, S)
    return v, ids, attn_mask, mask, vis.expand(B, 1, T, S)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_sums_and_counts_equal_a_float64_brute_force(case, dtype):
    v, _, _, mask, vis = _case(*case, dtype=dtype)
    assert mask.kinds & {"window", "documents"}
    total, count = visible_sum_and_count(v, mask, case[1])
    assert total.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    v64, w = v.double(), vis.double()
    want, bound = w @ v64, w @ v64.abs()
    assert torch.equal(count.expand_as(w[..., :1]).double(), w.sum(-1, keepdim=True))
    err = (total.double().expand_as(want) - want).abs()
    # float32 accumulation (bfloat16 inputs too): a few roundings of the sum of magnitudes; float64: exact to 1e-12.
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert (err <= tol * bound + 1e-300).all(), err.max()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("big", [1e30, 1e4])
def test_a_hidden_key_changes_no_bit_of_its_query(case, big):
    """For a query, move every key it cannot see (hidden by window, document, causal rule or padding): its sum and
    count stay bit for bit the same. A difference of prefix sums fails this (rounding carries the hidden value)."""
    v, _, _, mask, vis = _case(*case, dtype=torch.float32)
    B, T = v.shape[0], vis.shape[2]
    total, count = visible_sum_and_count(v, mask, case[1])
    total, count = total.expand(B, -1, T, -1), count.expand(B, 1, T, 1)
    for i in sorted({0, 1, T // 3, T // 2, T - 2, T - 1} & set(range(T))):
        hidden = ~vis[:, 0, i]  # (B, S)
        moved = torch.where(hidden[:, None, :, None], v + big, v)
        t2, c2 = visible_sum_and_count(moved, mask, case[1])
        assert torch.equal(t2.expand(B, -1, T, -1)[:, :, i], total[:, :, i]), f"query {i}"
        assert torch.equal(c2.expand(B, 1, T, 1)[:, :, i], count[:, :, i])


# Cases with keys that no query of a row may see: before every window, documents before the queries, padding.
UNSEEN = [
    (2, 4, 2, 9, 30, True, 4, None, "left"),
    (2, 2, 2, 8, 40, True, None, "rows", "right"),
    (3, 2, 1, 12, 45, True, 6, "rows", "random"),
    (2, 2, 2, 30, 30, True, 5, "short", "left"),
]


@pytest.mark.parametrize("case", UNSEEN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["cpu_flash", "exact"])
def test_keys_no_query_sees_change_no_bit_of_the_op_or_its_gradients(case, dtype, backend):
    B, Hq, Hkv, T, S = case[:5]
    v, ids, attn_mask, mask, vis = _case(*case, dtype=dtype)
    unseen = ~vis[:, 0].any(1)  # (B, S): keys that no query of the row may see
    assert unseen.any()
    q, k = torch.randn(B, Hq, T, 5).to(dtype), torch.randn(B, Hkv, S, 5).to(dtype)
    alpha, alpha_ma = torch.rand(B, Hq, T).to(dtype), torch.rand(Hq).to(dtype)
    dout = torch.randn(B, Hq, T, 5).to(dtype)
    rows = unseen[:, None, :, None]

    def run(k, v):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, alpha, alpha_ma)]
        out = affine_scaled_attention(*leaves, is_causal=case[5], window=case[6], document_ids=ids,
                                      attn_mask=attn_mask, enable_gqa=Hq != Hkv, backend=backend)
        return [out] + list(torch.autograd.grad(out, leaves, dout))

    for big in (1e30, 1e4):  # values and keys both: the kernel must not leak them either
        want, got = run(k, v), run(torch.where(rows, k + big, k), torch.where(rows, v + big, v))
        for name, a, b in zip(["out", "dq", "dk", "dv", "dalpha", "dalpha_ma"], got, want):
            if name in ("dk", "dv"):
                a, b = a.masked_fill(rows, 0), b.masked_fill(rows, 0)
            assert torch.equal(a, b), f"{name} moved (big = {big})"


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _ops(B, T, window, docs, pad, backward):
    torch.manual_seed(0)
    v = torch.randn(B, 2, T, 8, requires_grad=True)
    ids = None if docs is None else torch.sort(torch.randint(0, 4, (B, T)), dim=1).values
    attn_mask = None if pad is None else torch.rand(B, 1, 1, T) > 0.2
    mask = parse_mask(attn_mask, True, B, 2, T, T, v.device, window=window, document_ids=ids)
    with _CountOps() as c:
        total, count = visible_sum_and_count(v, mask, 2)
        if backward:
            torch.autograd.grad((total / count.clamp(min=1)).sum(), v)
    return c.n


@pytest.mark.parametrize("window, docs, pad", [(8, None, None), (8, None, "pad"), (None, "rows", None),
                                               (None, "rows", "pad"), (8, "rows", "pad")])
@pytest.mark.parametrize("backward", [False, True])
def test_the_number_of_ops_does_not_grow_with_the_batch(window, docs, pad, backward):
    counts = {B: _ops(B, 40, window, docs, pad, backward) for B in (1, 2, 8, 32)}
    assert len(set(counts.values())) == 1, counts


@pytest.mark.parametrize("window, docs, pad", [(8, None, None), (None, "rows", None), (6, "rows", "pad")])
def test_compiles_with_fullgraph_and_matches_eager(window, docs, pad):
    torch._dynamo.reset()
    B, T, S = 2, 21, 29
    v = torch.randn(B, 2, S, 4, requires_grad=True)
    ids = None if docs is None else torch.sort(torch.randint(0, 4, (B, S)), dim=1).values
    attn_mask = None if pad is None else torch.rand(B, 1, 1, S) > 0.2

    def mean(v):
        mask = parse_mask(attn_mask, True, B, 2, T, S, v.device, window=window, document_ids=ids)
        total, count = visible_sum_and_count(v, mask, 2)
        return total / count.clamp(min=1)

    got = torch.compile(mean, fullgraph=True, backend="aot_eager", dynamic=False)(v)
    want = mean(v)
    dout = torch.randn_like(want)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(got, v, dout)[0], torch.autograd.grad(want, v, dout)[0],
                               rtol=0, atol=0)


def test_the_op_compiles_with_fullgraph_and_matches_eager():
    """The public op over a window, documents and padding: the mean of V is differentiated by autograd here."""
    torch._dynamo.reset()
    B, T, S = 2, 21, 29
    q, k, v = torch.randn(B, 4, T, 8), torch.randn(B, 2, S, 8), torch.randn(B, 2, S, 8)
    alpha, alpha_ma = torch.rand(B, 4, T), torch.rand(4)
    ids, attn_mask = torch.sort(torch.randint(0, 4, (B, S)), dim=1).values, torch.rand(B, 1, 1, S) > 0.2

    def op(q, k, v, alpha):
        return affine_scaled_attention(q, k, v, alpha, alpha_ma, is_causal=True, window=6, document_ids=ids,
                                       attn_mask=attn_mask, enable_gqa=True)

    def result(f):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, alpha)]
        out = f(*leaves)
        return [out] + list(torch.autograd.grad(out.sum(), leaves))

    got = result(torch.compile(op, fullgraph=True, backend="aot_eager", dynamic=False))
    for a, b in zip(got, result(op)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
