"""The verdict rule of the Claims table on hand-made summaries: clear gain, clear loss, overlap, no sink formed."""
from __future__ import annotations

from pathlib import Path

import torch

from affine_attention.analysis.claims import claim_rows, sink_formed, verdict


def _runs(values_by_variant: dict[str, list[dict]]) -> dict:
    return {v: dict(enumerate(rows)) for v, rows in values_by_variant.items()}


def _row(rows, key):
    return next(r for r in rows if r["claim"] == key)


def test_rule_on_paired_differences():
    assert verdict([-0.10, -0.12, -0.11], -1, 0.01) == "holds"
    assert verdict([-0.10, -0.12, -0.11], +1, 0.01) == "does not hold"
    assert verdict([0.10, -0.12, 0.02], -1, 0.01) == "within seed spread"
    assert verdict([0.0, 0.0], -1, 0.01) == "within seed spread"
    assert verdict([-0.5], -1, 0.01) == "not testable here"
    assert verdict([], -1, 0.01) == "not testable here"
    # beyond the spread but below the minimum effect: negligible, whichever way it points
    assert verdict([-0.10, -0.12, -0.11], -1, 0.2) == "negligible"
    assert verdict([0.10, 0.12, 0.11], -1, 0.2) == "negligible"
    assert verdict([-0.10, -0.12, -0.11], -1, None) == "not testable here"  # no baseline value to scale it by


def _check_verdicts(claims_json: dict) -> int:
    """Every verdict of a summary.json "claims" record follows the rule from the numbers the record holds (n, mean,
    sample std, min_effect); returns how many verdicts were checked. The e2e test runs it on the real default run."""
    import math

    from affine_attention.analysis.claims import CLAIMS

    direction = {c.metric: c.direction for c in CLAIMS}
    checked = 0
    for m in claims_json["methods"].values():
        for r in m["rows"]:
            for side in ("baseline", "control"):
                got = r[side]
                if got.get("why") and got["verdict"] == "not testable here":
                    continue  # a set-up that cannot test the claim: its reason is a note, checked elsewhere
                n, mean, std = got["diff"]["n"], got["diff"]["mean"], got["diff"]["std"]
                if n < 2:
                    want = "not testable here"
                elif abs(mean) <= 2 * std:
                    want = "within seed spread"
                elif abs(mean) < r["min_effect"]:
                    want = "negligible"
                else:
                    want = "holds" if math.copysign(1, mean) == direction[r["metric"]] else "does not hold"
                assert got["verdict"] == want, (r["claim"], side, got, r["min_effect"])
                checked += 1
    return checked


def test_a_difference_just_under_the_minimum_effect_is_negligible_never_holds():
    """Paired runs from the same weights and data spread little: a 0.02% loss gain lies beyond 2 x its spread.
    The minimum effect (0.2% of softmax's loss) makes it negligible; just above the minimum it holds."""
    from affine_attention.analysis.claims import MIN_EFFECT

    least = MIN_EFFECT["final_train_loss"].of(1.67)
    assert abs(least - 0.00334) < 1e-12
    base = [1.67, 1.67, 1.67]
    tiny = [-0.0003, -0.0002, -0.0004]  # the case: -0.0003 ± 0.0001
    under = [-0.99 * least + e for e in (-1e-5, 0.0, 1e-5)]
    over = [-1.01 * least + e for e in (-1e-5, 0.0, 1e-5)]
    for diffs, want in ((tiny, "negligible"), (under, "negligible"), (over, "holds")):
        per_seed = _runs({"softmax": [{"final_train_loss": b} for b in base],
                          "affine": [{"final_train_loss": b + d} for b, d in zip(base, diffs)]})
        rows = claim_rows(per_seed, method="affine", baseline="softmax", control=None, baseline_sink=True)
        row = _row(rows, "train_loss")
        assert row["baseline"]["verdict"] == want, (diffs, row)
        assert abs(row["min_effect"] - least) < 1e-12
        if want == "negligible":
            assert "below the minimum effect 0.00334" in row["baseline"]["why"]
        assert _check_verdicts({"methods": {"affine": {"rows": rows}}}) == 1


def test_head_utilisation_is_not_testable_with_one_head_per_layer():
    from affine_attention.analysis.claims import attention_scalars
    from affine_attention.analysis.report_claims import claims_data

    class Rec:  # the two fields of analysis.capture.LayerRecord that attention_scalars reads
        def __init__(self, heads, first):
            self.stats = {"mean_total_mass": torch.full((heads,), 0.5), "first_token_mass": torch.full((heads,), first),
                          "entropy": torch.full((heads,), 1.0)}

        def layer_mean(self, key):
            return float(self.stats[key].mean())

    assert attention_scalars([Rec(1, 0.3), Rec(1, 0.3)])["heads_per_layer"] == 1
    assert attention_scalars([Rec(4, 0.3), Rec(2, 0.3)])["heads_per_layer"] == 2
    from affine_attention.analysis.compare_run import SeedRun

    for heads, want in ((1, "not testable here"), (2, "holds")):
        runs = {v: [SeedRun(v, s, Path("."), train=[]) for s in range(3)] for v in ("softmax", "affine")}
        # two layers; the head masses are even in affine (CV 0) and uneven in softmax, across heads where a layer
        # has several, across the two layers where it has one (which is what the CV would then compare)
        by_seed = {"softmax": {}, "affine": {s: [Rec(heads, 0.3), Rec(heads, 0.3)] for s in range(3)}}
        for s in range(3):
            by_seed["softmax"][s] = [Rec(heads, 0.3), Rec(heads, 0.3)]
            for i, r in enumerate(by_seed["softmax"][s]):
                r.stats["mean_total_mass"] = (torch.linspace(0.2, 0.8 + 0.01 * s, heads) if heads > 1
                                              else torch.tensor([0.2 + 0.6 * i + 0.01 * s]))
        data = claims_data(runs, {v: {"heldout_loss": {}, "final_train_loss": {}} for v in runs}, (0, 1), by_seed,
                           32)
        row = _row(data["methods"]["affine"]["rows"], "heads")["baseline"]
        assert row["verdict"] == want, (heads, row)
        if heads == 1:
            assert row["why"].startswith("one head per layer")


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
    """The Claims verdict and the report's Table 3 verdict are one rule (_numbers.spread_direction, then the minimum
    effect); the run's
    final train loss and the report's fallback average the same window (_numbers.final_window)."""
    from affine_attention._numbers import final_window, spread_direction
    from affine_attention.analysis import report_tables
    from affine_attention.analysis.compare_run import SeedRun, final_train_loss

    cases = {(-0.10, -0.12, -0.11): -1, (0.10, 0.12, 0.11): 1, (0.10, -0.12, 0.02): 0, (0.0, 0.0): 0, (-0.1,): None,
             (): None, (-0.10, None, -0.12, float("nan"), -0.11): -1}
    for diffs, want in cases.items():
        assert spread_direction(diffs) == want, diffs
        finite = [d for d in diffs if d is not None and d == d]
        words = {-1: "holds", 1: "does not hold", 0: "within seed spread", None: "not testable here"}[want]
        assert verdict(finite, -1, 0.01) == words
        # Table 3's verdict on a loss is the Claims rule's, minimum effect included (0.2% of the baseline's 5.0)
        numbers = {"softmax": {"heldout_loss": {s: 5.0 for s in range(len(finite))}},
                   "affine": {"heldout_loss": {s: 5.0 + d for s, d in enumerate(finite)}}}
        assert report_tables.loss_verdict(numbers, "affine", "softmax", "heldout_loss").endswith(words)
    assert [final_window(n) for n in (1, 10, 30, 100, 1000)] == [1, 1, 2, 5, 50]
    losses = [float(i) for i in range(100)]
    run = SeedRun("softmax", 0, Path("."), train=[{"loss": x} for x in losses])
    assert final_train_loss(run) == sum(losses[-5:]) / 5
