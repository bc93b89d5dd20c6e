"""metrics.jsonl has one reader, used by the trainer's resume and by the analysis of a compare folder alike: a last
line cut by a kill is skipped everywhere, a damaged line elsewhere is an error naming the file and the line."""
from __future__ import annotations

import json
import re

import pytest

RECORDS = [{"kind": "config", "config": {"train": {"steps": 2}}, "params": 10},
           {"kind": "train", "step": 1, "loss": 2.5, "grad_norm": 1.0},
           {"kind": "train", "step": 2, "loss": 2.25, "grad_norm": 0.5}]


def _compare_folder(tmp_path, text: str):
    """A compare folder with one run (softmax seed 0) whose metrics.jsonl is `text`."""
    log = tmp_path / "cmp" / "softmax" / "seed0" / "metrics.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text(text)
    return tmp_path / "cmp", log


def _lines(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


@pytest.mark.parametrize("torn", ['{"kind": "train", "step": 3, "lo', '{"kind": "train", "note": "caf\u00e9'])
def test_a_last_line_cut_by_a_kill_is_skipped_by_the_trainer_and_the_report_alike(tmp_path, torn):
    from affine_attention.analysis.compare_run import load_run
    from affine_attention.train.metrics import read_log
    from affine_attention.train.run_dir import final_losses, logged_config

    folder, log = _compare_folder(tmp_path, _lines(RECORDS))
    with open(log, "ab") as f:
        f.write(torn.encode("utf-8")[:-1])  # a kill mid-write: no newline, and here mid-character too
    assert read_log(log) == RECORDS
    assert logged_config(log.parent) == {"train": {"steps": 2}}
    assert final_losses(log.parent, steps=2, read=True)["last_step_loss"] == 2.25
    _, runs = load_run(folder)
    assert runs["softmax"][0].train == RECORDS[1:] and runs["softmax"][0].header == RECORDS[0]
    from affine_attention.analysis.gradstats import read_grad_norms  # the report's gradient statistics

    steps, norms = read_grad_norms(log)
    assert steps.tolist() == [1, 2] and norms.tolist() == [1.0, 0.5]
    # The same rule keeps a last record that is whole but lost only its newline.
    log.write_text(_lines(RECORDS)[:-1])
    assert read_log(log) == RECORDS and load_run(folder)[1]["softmax"][0].train == RECORDS[1:]


@pytest.mark.parametrize("bad, why", [('{"kind": "train", "step": 1, "lo', "malformed JSON"),
                                      ("[1, 2]", "expected a JSON object, got list")])
def test_a_damaged_line_before_the_last_is_an_error_naming_file_and_line(tmp_path, bad, why):
    from affine_attention.analysis.compare_run import load_run
    from affine_attention.train.metrics import read_log
    from affine_attention.train.run_dir import logged_config

    folder, log = _compare_folder(tmp_path, _lines(RECORDS[:1]) + bad + "\n" + _lines(RECORDS[1:]))
    expected = re.escape(f"{log}: line 2: {why}")
    for read in (lambda: read_log(log), lambda: logged_config(log.parent), lambda: load_run(folder)):
        with pytest.raises(ValueError, match=expected) as err:
            read()
        assert str(err.value).endswith("; repair or remove that line (only the last line can be cut by a kill)")


def test_the_one_atomic_writer_leaves_the_old_file_or_the_new_one_never_a_part(tmp_path):
    """A block that raises leaves the previous file and no temporary; one that ends puts the whole file in place.
    atomic_path serves writers that take a file name (safetensors' save_file)."""
    from affine_attention._files import atomic_file, atomic_path, atomic_write_bytes

    target = tmp_path / "result.bin"
    atomic_write_bytes(target, b"old")
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_file(target) as f:
            f.write(b"half of the new")
            raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["result.bin"]
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".") and not target.read_bytes() == b"new"
        tmp.write_bytes(b"new")
        assert target.read_bytes() == b"old"  # nothing visible before the block ends
    assert target.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["result.bin"]
