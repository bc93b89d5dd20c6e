"""Gradient-norm statistics on synthetic series with known moments, MAD and planted spikes."""
import json
import math

import numpy as np
import pytest

from affine_attention.analysis.gradstats import grad_norm_stats, read_grad_norms, spike_counts, stats_from_file


def series(n=500):
    """Base norms cycle 0.98, 0.99, 1.00, 1.01, 1.02: median 1.00, MAD 0.01, population std sqrt(2e-4)."""
    return 1.0 + 0.01 * (np.arange(n) % 5 - 2)


def test_moments_of_known_series():
    st = grad_norm_stats(series())
    assert st["n"] == 500 and st["n_nonfinite"] == 0
    assert st["mean"] == pytest.approx(1.0)
    assert st["variance"] == pytest.approx(2e-4)
    assert st["std"] == pytest.approx(math.sqrt(2e-4))
    assert st["cv"] == pytest.approx(math.sqrt(2e-4) / 1.0)


def test_population_std_by_hand():
    st = grad_norm_stats([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0])
    assert (st["mean"], st["std"], st["variance"]) == pytest.approx((5.0, 2.0, 4.0))
    assert st["cv"] == pytest.approx(0.4)


def test_window_is_half_open_on_step_values():
    norms = np.array([1.0, 2.0, 3.0, 100.0])
    steps = np.array([0, 250, 499, 500])
    st = grad_norm_stats(norms, steps, window=(0, 500))
    assert st["n"] == 3 and st["mean"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no finite grad_norm"):
        grad_norm_stats(norms, steps, window=(600, 700))


def test_spikes_planted():
    x = series(600)
    # thresholds: median 1.0, MAD 0.01 -> k=6: 1.06, k=9: 1.09. Plant below both, between, above both.
    # Replacing values changes median/MAD slightly; plant symmetric pairs so they stay at 1.0 / 0.01.
    x[12] = 1.05   # not a spike (was 1.00)
    x[22] = 1.075  # k=6 only   (was 1.00)
    x[32] = 1.5    # both       (was 1.00)
    x[42] = 20.0   # both       (was 1.00)
    x[550] = 50.0  # outside the window
    w = x[:500]
    assert np.median(w) == pytest.approx(1.0) and np.median(np.abs(w - 1.0)) == pytest.approx(0.01)
    assert spike_counts(x, ks=(6, 9)) == {6: 3, 9: 2}
    assert spike_counts(x, ks=(6, 9), window=(0, 600)) == {6: 4, 9: 3}


def test_spikes_by_hand_mad():
    # 0..8 and 10.5: median 4.5; |x - 4.5| sorted .5 .5 1.5 1.5 2.5 2.5 3.5 3.5 4.5 6 -> MAD 2.5
    x = np.append(np.arange(9, dtype=float), 10.5)
    # thresholds 4.5 + k * 2.5 = 7, 9.5, 12: above them are {8, 10.5}, {10.5}, {}
    assert spike_counts(x, ks=(1, 2, 3)) == {1: 2, 2: 1, 3: 0}


def test_zero_mad_and_nonfinite():
    x = np.array([1.0, 1.0, 1.0, 2.0, float("inf"), float("nan")])
    assert spike_counts(x, ks=(6,)) == {6: 2}  # 2.0 and inf exceed median + 6 * 0
    st = grad_norm_stats(x)
    assert st["n"] == 4 and st["n_nonfinite"] == 2 and st["mean"] == pytest.approx(1.25)


def write_jsonl(path, lines):
    path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")


def test_stats_from_file(tmp_path):
    x = series(500)
    x[100] = 2.0
    lines = [{"run": "demo", "config": {"lr": 1e-3}}]  # header: no step, ignored
    for s, v in enumerate(x):
        lines.append({"step": s, "loss": 3.0, "grad_norm": float(v), "lr": 1e-3})
        if s % 100 == 0:
            lines.append({"step": s, "kind": "eval", "eval_loss": 2.9})  # eval record: not a step line
    lines.insert(50, "")  # blank lines are fine
    lines.append({"step": 3, "grad_norm": 1.0})  # resumed run re-logs step 3: last one wins
    path = tmp_path / "metrics.jsonl"
    write_jsonl(path, lines)
    steps, norms = read_grad_norms(path)
    assert steps.tolist() == list(range(500)) and norms[3] == 1.0
    out = stats_from_file(path, window=(0, 500), ks=(6, 9))
    assert out["n"] == 500 and out["spikes"] == {6: 1, 9: 1}
    assert out["median"] == pytest.approx(1.0) and out["mad"] == pytest.approx(0.01)
    assert out["window"] == (0, 500)


def test_malformed_json_names_line(tmp_path):
    path = tmp_path / "m.jsonl"
    write_jsonl(path, [{"step": 0, "grad_norm": 1.0}, {"step": 1, "grad_norm": 1.0}, '{"step": 2, "grad_norm": '])
    with pytest.raises(ValueError, match="line 3"):
        read_grad_norms(path)


def test_step_line_without_grad_norm_is_an_error(tmp_path):
    path = tmp_path / "m.jsonl"
    write_jsonl(path, [{"step": 0, "grad_norm": 1.0}, {"step": 1, "loss": 2.0}])
    with pytest.raises(ValueError, match="line 2.*grad_norm"):
        read_grad_norms(path)


def test_bad_arrays():
    with pytest.raises(ValueError, match="norms must be 1-D"):
        grad_norm_stats(np.zeros((2, 2)))
    with pytest.raises(ValueError, match="steps must have the same shape"):
        spike_counts([1.0, 2.0], steps=[0])
