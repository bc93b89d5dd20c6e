"""The verdict rule of the Claims table on hand-made summaries: clear gain, clear loss, overlap, no sink formed."""
from __future__ import annotations

from pathlib import Path

from affine_attention.analysis.claims import claim_rows, sink_formed, verdict


def _runs(values_by_variant: dict[str, list[dict]]) -> dict:
    return {v: dict(enumerate(rows)) for v, rows in values_by_variant.items()}


def _row(rows, key):
    return next(r for r in rows if r["claim"] == key)


def test_rule_on_paired_differences():
    assert verdict([-0.10, -0.12, -0.11], -1) == "holds"
    assert verdict([-0.10, -0.12, -0.11], +1) == "does not hold"
    assert verdict([0.10, -0.12, 0.02], -1) == "within seed spread"
    assert verdict([0.0, 0.0], -1) == "within seed spread"
    assert verdict([-0.5], -1) == "not testable here"
    assert verdict([], -1) == "not testable here"


def test_clear_gain_clear_loss_and_overlap_against_baseline_and_control():
    per_seed = _runs({
        "softmax": [{"heldout_loss": 5.40, "final_train_loss": 5.20}, {"heldout_loss": 5.42, "final_train_loss": 5.10}],
        "scaled_softmax": [{"heldout_loss": 5.30, "final_train_loss": 5.00}, {"heldout_loss": 5.33, "final_train_loss": 5.02}],
        "affine": [{"heldout_loss": 5.31, "final_train_loss": 5.30}, {"heldout_loss": 5.32, "final_train_loss": 5.22}],
    })
    rows = claim_rows(per_seed, method="affine", baseline="softmax", control="scaled_softmax", baseline_sink=True)
    held, train = _row(rows, "heldout"), _row(rows, "train_loss")
    assert held["baseline"]["verdict"] == "holds"  # -0.09, -0.10
    assert held["control"]["verdict"] == "within seed spread"  # +0.01, -0.01
    assert train["baseline"]["verdict"] == "does not hold"  # +0.10, +0.12
    assert held["baseline"]["diff"]["n"] == 2 and abs(held["baseline"]["diff"]["mean"] + 0.095) < 1e-9
    assert {r["claim"] for r in rows} == {"heldout", "train_loss"}  # unmeasured claims are left out


def test_first_token_claim_needs_a_sink_in_the_baseline():
    per_seed = _runs({"softmax": [{"first_token_mass": 0.30}, {"first_token_mass": 0.32}],
                      "affine": [{"first_token_mass": 0.10}, {"first_token_mass": 0.11}]})
    with_sink = claim_rows(per_seed, method="affine", baseline="softmax", control=None, baseline_sink=True)
    assert _row(with_sink, "first_token")["baseline"]["verdict"] == "holds"
    assert _row(with_sink, "first_token")["control"]["verdict"] == "not testable here"
    none = claim_rows(per_seed, method="affine", baseline="softmax", control=None, baseline_sink=False)
    row = _row(none, "first_token")["baseline"]
    assert row["verdict"] == "not testable here" and "forms no attention sink" in row["why"]


def test_sink_threshold():
    uniform = 0.02
    assert sink_formed([0.30, 0.25, 0.01, 0.02], uniform)
    assert not sink_formed([0.30, 0.02, 0.01, 0.02], uniform)  # one layer only
    assert not sink_formed([0.05, 0.05], uniform)  # 2.5x uniform: below the 3x threshold
    assert sink_formed([0.5], uniform)  # a one-layer model needs its only layer
    assert not sink_formed([], uniform)


def test_one_rule_one_loss_window_for_the_claims_the_report_tables_and_the_run():
    """The Claims verdict and the report's table verdict are two wordings of _numbers.spread_direction; the run's
    final train loss and the report's fallback average the same window (_numbers.final_window)."""
    from affine_attention._numbers import final_window, spread_direction
    from affine_attention.analysis import report_tables
    from affine_attention.analysis.compare_run import SeedRun, final_train_loss

    cases = {(-0.10, -0.12, -0.11): -1, (0.10, 0.12, 0.11): 1, (0.10, -0.12, 0.02): 0, (0.0, 0.0): 0, (-0.1,): None,
             (): None, (-0.10, None, -0.12, float("nan"), -0.11): -1}
    table = {-1: "method lower", 1: "method higher", 0: "within seed spread"}
    for diffs, want in cases.items():
        assert spread_direction(diffs) == want, diffs
        finite = [d for d in diffs if d is not None and d == d]
        assert verdict(finite, -1) == {-1: "holds", 1: "does not hold", 0: "within seed spread",
                                       None: "not testable here"}[want]
        assert report_tables.verdict(list(diffs)) == table.get(want, "one seed: no spread estimate" if finite else "-")
    assert [final_window(n) for n in (1, 10, 30, 100, 1000)] == [1, 1, 2, 5, 50]
    losses = [float(i) for i in range(100)]
    run = SeedRun("softmax", 0, Path("."), train=[{"loss": x} for x in losses])
    assert final_train_loss(run) == sum(losses[-5:]) / 5
