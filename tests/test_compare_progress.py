"""`compare`'s overall progress line: run i of n, elapsed time and an estimate of the time left, from the runs
trained so far (resumed runs cost nothing and do not enter the rate)."""
from __future__ import annotations

import re

from affine_attention.train import compare as compare_mod
from affine_attention.train import loop
from affine_attention.train.compare import compare, overall_line
from affine_attention.train.config_load import load_config
from test_train_helpers import tiny  # noqa: F401  (fixture)


def test_line_states_position_elapsed_and_estimate():
    assert overall_line(1, 12, 0.4, 0, 12) == "[compare] run 1 of 12, 0s elapsed, time left known after the first run"
    # 3 runs took 90 s: 30 s each, 9 left (this one included) -> 4m30s.
    assert overall_line(4, 12, 90.0, 3, 9) == "[compare] run 4 of 12, 1m30s elapsed, about 4m30s left"
    # Resumed runs: 2 of 3 trained in 60 s, 1 left -> 30 s.
    assert overall_line(6, 6, 60.0, 2, 1) == "[compare] run 6 of 6, 1m00s elapsed, about 30s left"


def test_time_left_includes_the_report_that_follows_training():
    """compare's default writes the report after training (about 2.5 min of the default run's 6): the estimate of
    the time left counts it, from the checkpoints the report will read."""
    from affine_attention.analysis.report import S_PER_CHECKPOINT, checkpoints_read, estimate

    # 3 runs took 90 s, 9 left -> 4m30s of training, then a 2m24s report
    assert overall_line(4, 12, 90.0, 3, 9, ("the report", 144.0)) == \
        "[compare] run 4 of 12, 1m30s elapsed, about 6m54s left (training 4m30s, then the report about 2m24s)"
    assert overall_line(1, 12, 0.0, 0, 12, ("the report", 144.0)) == \
        "[compare] run 1 of 12, 0s elapsed, time left known after the first run; then the report about 2m24s"
    probe = load_config("sink-probe").to_dict()  # 400 steps, a checkpoint every 50, 8 kept
    # per run: its final checkpoint (attention diagnostics), then 8 periodic and the final again (sink measurements)
    assert checkpoints_read(probe, 24) == 24 * 10
    assert estimate(probe, 24) == ("the report", 240 * S_PER_CHECKPOINT)
    assert checkpoints_read(load_config("tiny").to_dict(), 12) == 12  # no probe: the final checkpoints only


def test_compare_prints_one_overall_line_per_run_with_a_fake_clock(tiny, tmp_path, monkeypatch):  # noqa: F811
    clock = {"t": 1000.0}

    def fake_train(cfg, out_dir, **kw):
        clock["t"] += 20.0  # every run "takes" 20 s
        out_dir.mkdir(parents=True, exist_ok=True)
        result = {"variant": kw["variant"], "params": 10, "final_train_loss": 1.0, "heldout_loss": 1.0,
                  "heldout_ppl": 2.7, "tokens_per_s": 1.0, "wall_time_s": 20.0}
        (out_dir / "result.json").write_text(__import__("json").dumps(result))
        return result

    monkeypatch.setattr(loop, "train", fake_train)
    monkeypatch.setattr(compare_mod.time, "time", lambda: clock["t"])
    cfg = load_config("tiny", tiny + ["compare.variants=['softmax', 'affine']"])
    lines: list[str] = []
    compare(cfg, tmp_path / "cmp", seeds=2, log=lines.append)
    overall = [m for m in lines if re.match(r"\[compare\] run \d+ of", m)]
    assert overall == ["[compare] run 1 of 4, 0s elapsed, time left known after the first run",
                       "[compare] run 2 of 4, 20s elapsed, about 1m00s left",
                       "[compare] run 3 of 4, 40s elapsed, about 40s left",
                       "[compare] run 4 of 4, 1m00s elapsed, about 20s left"]
    assert lines[-1] == "[compare] 4 of 4 runs done in 1m20s"

    # With the report to follow (the command's default), every estimate and the closing line count it.
    lines.clear()
    compare(cfg, tmp_path / "with-report", seeds=2, log=lines.append, after=lambda c, n: ("the report", 10.0 * n))
    assert [m for m in lines if re.match(r"\[compare\] run \d+ of", m)][1] == \
        "[compare] run 2 of 4, 20s elapsed, about 1m40s left (training 1m00s, then the report about 40s)"
    assert lines[-1] == "[compare] 4 of 4 runs done in 1m20s; then the report about 40s"

    # Resume after deleting one run: only that run trains; the reused ones do not count as trained.
    (tmp_path / "cmp" / "affine" / "seed1" / "result.json").unlink()
    lines.clear()
    compare(cfg, tmp_path / "cmp", seeds=2, resume=True, log=lines.append)
    assert [m for m in lines if re.match(r"\[compare\] run \d+ of", m)] == [
        "[compare] run 4 of 4, 0s elapsed, time left known after the first run"]
