"""compare --tasks: zero-shot accuracy of every final checkpoint joins Table 1 and the Claims table; the offline
fixture tasks are refused before any training (they are pipeline tests, never accuracies)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_train_helpers import sets, tiny  # noqa: F401  (fixture)

from affine_attention.cli import main

FIXTURE_DATA = Path(__file__).resolve().parents[1] / "affine_attention" / "eval" / "fixtures" / "data"


def _local_task(folder: Path) -> Path:
    """A user's own task file: lm-eval's piqa definition on a local JSONL (here 8 rows in piqa's schema)."""
    import lm_eval

    folder.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(x) for x in (FIXTURE_DATA / "piqa.fixture.jsonl").read_text().splitlines() if x.strip()]
    (folder / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (rows * 4)[:8]))
    piqa = Path(lm_eval.__file__).parent / "tasks" / "piqa" / "piqa.yaml"
    (folder / "my_piqa.yaml").write_text(
        f"include: {piqa}\ntask: my_piqa\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    validation: {folder / 'mine.jsonl'}\n"
        "training_split: null\nvalidation_split: validation\ntest_split: null\n")
    return folder


def test_fixture_tasks_are_refused_before_training(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["compare", *sets(tiny + ["train.steps=2"]), "--out", str(out), "--tasks", "fixtures"]) == 2
    assert "offline fixture tasks" in capsys.readouterr().err
    assert not out.exists()  # nothing trained
    assert main(["compare", *sets(tiny), "--out", str(out), "--tasks", "fixture_piqa"]) == 2
    capsys.readouterr()
    # A name lm-eval does not know fails before training too (not after every variant and seed has trained).
    assert main(["compare", *sets(tiny + ["train.steps=2"]), "--out", str(out), "--tasks", "arc_eazy"]) == 2
    assert "arc_eazy" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow  # 4 trainings, 4 lm-eval runs and the report: minutes on 2 cores
def test_local_tasks_reach_table_1_and_the_claims(tiny, tmp_path):
    out = tmp_path / "run"
    tasks = _local_task(tmp_path / "tasks")
    args = ["compare", *sets(tiny + ["train.steps=2", "compare.variants=['softmax', 'affine']", "compare.seeds=2"]),
            "--out", str(out), "--tasks", "my_piqa", "--include-path", str(tasks)]
    assert main(args) == 0
    result = json.loads((out / "affine" / "seed1" / "result.json").read_text())
    assert set(result["zero_shot"]) == {"my_piqa"} and 0 <= result["zero_shot"]["my_piqa"] <= 100
    summary = json.loads((out / "summary.json").read_text())
    assert summary["variants"]["softmax"]["zero_shot"]["my_piqa"]["values"][0] == pytest.approx(
        json.loads((out / "softmax" / "seed0" / "result.json").read_text())["zero_shot"]["my_piqa"])
    rows = {r["claim"]: r for r in summary["claims"]["methods"]["affine"]["rows"]}
    assert rows["zero_shot"]["baseline"]["diff"]["n"] == 2
    assert "my_piqa" in (out / "report.md").read_text()
