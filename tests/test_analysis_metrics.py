"""Attention metrics against hand-built weight matrices with known answers."""
import math

import pytest
import torch

from affine_attention.analysis.layer_stats import LayerStats
from affine_attention.analysis.mass_metrics import (
    first_token_mass,
    head_utilisation,
    mass_histogram,
    mean_total_mass,
    total_mass,
)
from affine_attention.analysis.pattern_metrics import attention_entropy, mean_attention_map
from affine_attention.analysis.scale_metrics import alpha_distribution, mean_qk_logit

T = 5


def causal(T_=T, S=None):
    S = T_ if S is None else S
    return torch.ones(T_, S, dtype=torch.bool).tril()[None, None]


def uniform_causal(B=2, H=3, T_=T):
    """w[i, j] = 1 / (i + 1) for j <= i."""
    vis = causal(T_)
    w = vis.double() / torch.arange(1, T_ + 1, dtype=torch.float64)[:, None]
    return w.expand(B, H, T_, T_).clone(), vis


def first_token_only(B=2, H=3, T_=T):
    w = torch.zeros(B, H, T_, T_, dtype=torch.float64)
    w[..., 0] = 1.0
    return w, causal(T_)


def random_causal_softmax(B=3, H=4, T_=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T_, T_, generator=g)
    vis = causal(T_)
    return x.masked_fill(~vis, float("-inf")).softmax(-1), vis


# --- uniform rows and first-token rows -----------------------------------------------------------------------
def test_uniform_rows():
    w, vis = uniform_causal()
    expected_ent = sum(math.log(i + 1) for i in range(T)) / T
    expected_first = sum(1 / (i + 1) for i in range(T)) / T
    torch.testing.assert_close(attention_entropy(w, vis), torch.full((3,), expected_ent, dtype=torch.float64))
    torch.testing.assert_close(first_token_mass(w, vis), torch.full((3,), expected_first, dtype=torch.float64))
    tot = total_mass(w, vis)
    torch.testing.assert_close(tot[0, 0], torch.tensor([i / (i + 1) for i in range(T)], dtype=torch.float64))
    torch.testing.assert_close(total_mass(w, vis, exclude_first=False), torch.ones(2, 3, T, dtype=torch.float64))


def test_all_mass_on_first_token():
    w, vis = first_token_only()
    torch.testing.assert_close(first_token_mass(w, vis), torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(attention_entropy(w, vis), torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(mean_total_mass(w, vis), torch.zeros(3, dtype=torch.float64))
    # visible=None means all keys visible: key 0 is still the first token
    torch.testing.assert_close(first_token_mass(w), torch.ones(3, dtype=torch.float64))


def test_masked_entries_are_ignored_whatever_they_hold():
    w, vis = uniform_causal()
    garbage = w.masked_fill(~vis, float("nan"))
    garbage[..., 0, 1] = 100.0  # above the diagonal: masked
    torch.testing.assert_close(attention_entropy(garbage, vis), attention_entropy(w, vis))
    torch.testing.assert_close(total_mass(garbage, vis), total_mass(w, vis))


# --- sink ------------------------------------------------------------------------------------------------------
def test_sink_mass_rows():
    n, s = 4, 0.25
    w = torch.full((1, 2, 1, n), (1 - s) / n, dtype=torch.float64)
    sink = torch.full((1, 2, 1), s, dtype=torch.float64)
    expected = -(s * math.log(s) + (1 - s) * math.log((1 - s) / n))
    torch.testing.assert_close(attention_entropy(w, sink_mass=sink), torch.full((2,), expected, dtype=torch.float64))
    # without the sink the keys alone are uniform: log n
    torch.testing.assert_close(attention_entropy(w), torch.full((2,), math.log(n), dtype=torch.float64))
    # raw mass over all keys is 1 - s; excluding the sink share it is 1
    torch.testing.assert_close(total_mass(w, exclude_first=False), torch.full((1, 2, 1), 1 - s, dtype=torch.float64))
    raw = mean_total_mass(w, sink_mass=sink, exclude_first=False, sink_excluded=False)
    torch.testing.assert_close(raw, torch.full((2,), 1 - s, dtype=torch.float64))
    se = mean_total_mass(w, sink_mass=sink, exclude_first=False, sink_excluded=True)
    torch.testing.assert_close(se, torch.ones(2, dtype=torch.float64))
    se_first = mean_total_mass(w, sink_mass=sink)  # exclude_first=True: (n - 1) / n of the key mass
    torch.testing.assert_close(se_first, torch.full((2,), (n - 1) / n, dtype=torch.float64))


def test_all_mass_on_sink_is_excluded_from_sink_normalised_mass():
    w = torch.zeros(1, 1, 2, 3, dtype=torch.float64)
    w[0, 0, 1] = torch.tensor([0.2, 0.3, 0.5])
    sink = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)  # query 0 gives everything to the sink
    torch.testing.assert_close(mean_total_mass(w, sink_mass=sink), torch.tensor([0.8], dtype=torch.float64))
    # query 0's entropy is 0 (all on the sink), query 1's that of [0.2, 0.3, 0.5]
    h1 = -sum(p * math.log(p) for p in (0.2, 0.3, 0.5))
    torch.testing.assert_close(attention_entropy(w, sink_mass=sink), torch.tensor([h1 / 2], dtype=torch.float64))


# --- affine rows with negative entries ---------------------------------------------------------------------------
def test_affine_row_with_negative_entries():
    # p = one-hot on key 0, alpha = 1, alpha_ma = 0.2, N = 4: a = p + (0.2 - 1) / 4 = [0.8, -0.2, -0.2, -0.2]
    a = torch.tensor([0.8, -0.2, -0.2, -0.2], dtype=torch.float64).view(1, 1, 1, 4)
    assert float(a.sum()) == pytest.approx(0.2)  # rows sum to alpha_ma
    q = torch.tensor([0.8, 0.2, 0.2, 0.2]) / 1.4
    expected = float(-(q * q.log()).sum())
    assert float(attention_entropy(a)) == pytest.approx(expected)
    assert float(first_token_mass(a)) == pytest.approx(0.8)
    assert float(total_mass(a)) == pytest.approx(-0.6)
    assert float(total_mass(a, exclude_first=False)) == pytest.approx(0.2)


def test_zero_rows_are_excluded_from_entropy():
    w = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    w[0, 0, 1] = 0.5  # row 0 has no mass at all, row 1 is uniform
    torch.testing.assert_close(attention_entropy(w), torch.tensor([math.log(2)], dtype=torch.float64))


# --- padding ---------------------------------------------------------------------------------------------------
def left_padded():
    """Sequence 0: 2 pad tokens then 3 real ones; sequence 1: 5 real. Causal + padding mask."""
    pad = torch.tensor([[False, False, True, True, True], [True] * 5])
    vis = causal() & pad[:, None, None, :]  # (2, 1, 5, 5)
    w = vis.double() / vis.sum(-1, keepdim=True).clamp(min=1)
    w = w.expand(2, 2, T, T).clone()
    w[0, :, :2] = float("nan")  # padded queries hold garbage
    return w, vis, pad


def test_left_padding_first_visible_key_and_padded_queries():
    w, vis, qmask = left_padded()
    # sequence 0 has 3 real queries seeing 1, 2, 3 keys; sequence 1 has 5 seeing 1..5
    counts = [1, 2, 3, 1, 2, 3, 4, 5]
    exp_first = sum(1 / c for c in counts) / len(counts)
    exp_ent = sum(math.log(c) for c in counts) / len(counts)
    torch.testing.assert_close(first_token_mass(w, vis, qmask), torch.full((2,), exp_first, dtype=torch.float64))
    torch.testing.assert_close(attention_entropy(w, vis, qmask), torch.full((2,), exp_ent, dtype=torch.float64))
    exp_tot = sum((c - 1) / c for c in counts) / len(counts)
    torch.testing.assert_close(mean_total_mass(w, vis, qmask), torch.full((2,), exp_tot, dtype=torch.float64))
    counts_hist, _ = mass_histogram(total_mass(w, vis), qmask, bins=4)
    assert int(counts_hist.sum()) == len(counts) * 2  # 8 real queries x 2 heads


def test_per_head_visible_mask():
    w = torch.full((1, 2, 1, 4), 0.25, dtype=torch.float64)
    vis = torch.tensor([[True] * 4, [False, False, True, True]]).view(1, 2, 1, 4)
    w[0, 1, 0] = torch.tensor([9.0, 9.0, 0.5, 0.5])  # head 1 sees only keys 2, 3
    torch.testing.assert_close(attention_entropy(w, vis), torch.tensor([math.log(4), math.log(2)], dtype=torch.float64))
    torch.testing.assert_close(first_token_mass(w, vis), torch.tensor([0.25, 0.5], dtype=torch.float64))


def test_head_without_real_queries_is_nan():
    w, vis = uniform_causal(B=1, H=1)
    out = first_token_mass(w, vis, torch.zeros(1, T, dtype=torch.bool))
    assert torch.isnan(out).all()


# --- utilisation -------------------------------------------------------------------------------------------------
def test_head_utilisation_minmax_over_grid():
    m = torch.tensor([[0.2, 0.4], [0.6, 1.0]])
    torch.testing.assert_close(head_utilisation(m), torch.tensor([[0.0, 0.25], [0.5, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(head_utilisation([m[0], m[1]]), head_utilisation(m))
    assert torch.equal(head_utilisation(torch.full((3, 4), 0.7)), torch.zeros(3, 4, dtype=torch.float64))
    with_nan = head_utilisation(torch.tensor([[0.0, float("nan")], [2.0, 1.0]]))
    assert torch.isnan(with_nan[0, 1]) and float(with_nan[1, 1]) == 0.5


# --- maps, alpha, logits, histograms ---------------------------------------------------------------------------
def test_mean_attention_map():
    w, vis = uniform_causal(B=2, H=3, T_=4)
    m = mean_attention_map(w, vis, size=3)
    expected = torch.tensor([[1, 0, 0], [0.5, 0.5, 0], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    torch.testing.assert_close(m, expected)
    assert mean_attention_map(w, vis, size=30).shape == (4, 4)  # clamped to the sequence
    # a padded query in one sequence: the row averages over the other sequence only
    qm = torch.tensor([[True, False, True, True], [True, True, True, True]])
    w2 = w.clone()
    w2[0, :, 1] = 7.0
    torch.testing.assert_close(mean_attention_map(w2, vis, size=3, query_mask=qm), expected)


def test_alpha_distribution():
    alpha = torch.tensor([[[0.0, 1.0, 2.0, 99.0]], [[3.0, 4.0, 5.0, 6.0]]]).expand(2, 2, 4).clone()
    alpha[:, 1] += 10
    qm = torch.tensor([[True, True, True, False], [True, True, True, True]])
    d = alpha_distribution(alpha, qm, quantiles=(0.0, 0.5, 1.0))
    vals = torch.tensor([0.0, 1, 2, 3, 4, 5, 6], dtype=torch.float64)
    torch.testing.assert_close(d["mean"], torch.tensor([3.0, 13.0], dtype=torch.float64))
    torch.testing.assert_close(d["std"], torch.full((2,), float(vals.std(correction=0)), dtype=torch.float64))
    torch.testing.assert_close(d["quantiles"], torch.tensor([[0.0, 10], [3, 13], [6, 16]], dtype=torch.float64))
    assert d["n"] == 7 and d["values"].shape == (14,)


def test_mean_qk_logit_ignores_masked():
    logits = torch.tensor([[1.0, float("-inf")], [-3.0, 2.0]]).view(1, 1, 2, 2)
    mean, mean_abs = mean_qk_logit(logits, causal(2))
    assert mean == pytest.approx(0.0) and mean_abs == pytest.approx(2.0)


def test_mass_histogram_edges_and_clipping():
    total = torch.tensor([-0.5, 0.0, 0.1, 0.5, 0.99, 1.0, 3.0]).view(1, 1, 7)
    counts, edges = mass_histogram(total, bins=2, value_range=(0.0, 1.0))
    torch.testing.assert_close(edges, torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64))
    assert counts.tolist() == [3, 4]  # [.. 0.5) gets -0.5, 0, 0.1; [0.5 ..] gets 0.5, 0.99, 1.0, 3.0


# --- chunk-wise accumulation == one-shot ------------------------------------------------------------------------
def oneshot(w, vis, qmask, sink=None):
    return {
        "first_token_mass": first_token_mass(w, vis, qmask),
        "entropy": attention_entropy(w, vis, qmask, sink),
        "mean_total_mass": mean_total_mass(w, vis, qmask, sink, sink_excluded=False),
        "mean_total_mass_sink_excluded": mean_total_mass(w, vis, qmask, sink),
    }


@pytest.mark.parametrize("with_sink", [False, True])
def test_layer_stats_chunked_equals_one_shot(with_sink):
    w, vis = random_causal_softmax(B=3, H=4, T_=7)
    qmask = torch.ones(3, 7, dtype=torch.bool)
    qmask[1, :2] = False
    sink = None
    if with_sink:
        sink = torch.rand(3, 4, 7, generator=torch.Generator().manual_seed(1)) * 0.5
        w = w * (1 - sink)[..., None]
    vis = vis.expand(3, 1, 7, 7)
    ref = oneshot(w, vis, qmask, sink)
    whole = LayerStats()
    whole.update(w, vis, qmask, sink)
    by_batch, by_query = LayerStats(), LayerStats()
    for b in range(3):
        by_batch.update(w[b:b + 1], vis[b:b + 1], qmask[b:b + 1], None if sink is None else sink[b:b + 1])
    for lo, hi in ((0, 3), (3, 4), (4, 7)):
        by_query.update(w[:, :, lo:hi], vis[:, :, lo:hi], qmask[:, lo:hi], None if sink is None else sink[..., lo:hi])
    r = whole.result()
    for key, val in ref.items():
        torch.testing.assert_close(r[key], val)
    for other in (by_batch.result(), by_query.result()):
        for key in ref:
            torch.testing.assert_close(other[key], r[key])
        assert torch.equal(other["hist_counts"], r["hist_counts"])
        assert torch.equal(other["n_queries"], r["n_queries"])
    counts, _ = mass_histogram(total_mass(w, vis), qmask, bins=r["hist_edges"])
    assert torch.equal(r["hist_counts"].sum(0), counts)
    assert r["n_queries"].tolist() == [19] * 4


def test_layer_stats_errors():
    with pytest.raises(RuntimeError):
        LayerStats().result()
    st = LayerStats()
    st.update(*uniform_causal(B=1, H=3))
    with pytest.raises(ValueError, match="heads"):
        st.update(*uniform_causal(B=1, H=2))


# --- bad input -------------------------------------------------------------------------------------------------
def test_bad_shapes_raise_value_error_naming_argument():
    w, vis = uniform_causal()
    with pytest.raises(ValueError, match=r"w must have shape \(B, H, T, S\)"):
        first_token_mass(w[0])
    with pytest.raises(ValueError, match="visible must have shape"):
        attention_entropy(w, vis[..., :3])
    with pytest.raises(ValueError, match="visible must be a bool"):
        attention_entropy(w, vis.float())
    with pytest.raises(ValueError, match="query_mask must have shape"):
        first_token_mass(w, vis, torch.ones(2, T + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="sink_mass must have shape"):
        attention_entropy(w, vis, sink_mass=torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"masses must have shape \(L, H\)"):
        head_utilisation(torch.zeros(3))
    with pytest.raises(ValueError, match=r"alpha must be .* \(B, H, T\)"):
        alpha_distribution(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"total must have shape \(B, H, T\)"):
        mass_histogram(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="logits must have shape"):
        mean_qk_logit(torch.zeros(2, 2), None)
