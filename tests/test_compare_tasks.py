"""compare --tasks: zero-shot accuracy of every final checkpoint joins Table 1 and the Claims table; the offline
fixture tasks, and tasks whose data cannot be had (offline and not cached, or no hub), are refused before any
training."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_train_helpers import sets, tiny  # noqa: F401  (fixture)

from affine_attention.cli import main
from affine_attention.eval import FIXTURE_TASKS

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
    assert main(["compare", "--config", "tiny", *sets(tiny + ["train.steps=2"]), "--out", str(out), "--tasks", "fixtures"]) == 2
    assert "offline fixture tasks" in capsys.readouterr().err
    assert not out.exists()  # nothing trained
    assert main(["compare", "--config", "tiny", *sets(tiny), "--out", str(out), "--tasks", "fixture_piqa"]) == 2
    capsys.readouterr()
    # A name lm-eval does not know fails before training too (not after every variant and seed has trained).
    assert main(["compare", "--config", "tiny", *sets(tiny + ["train.steps=2"]), "--out", str(out), "--tasks", "arc_eazy"]) == 2
    assert "arc_eazy" in capsys.readouterr().err
    assert not out.exists()


@pytest.fixture
def offline_empty_cache(tmp_path, monkeypatch):
    """Offline, with empty datasets and hub caches: the tests mean the same where the data was downloaded once."""
    import datasets
    import huggingface_hub.constants as hub_constants

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    # Both libraries read these once, at import: the variables alone would not reach them.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


def test_paper_task_without_its_data_fails_before_training(tiny, tmp_path, offline_empty_cache, capsys):
    out = tmp_path / "run"
    args = ["compare", "--config", "tiny", *sets(tiny + ["train.steps=2", "compare.variants=['softmax']", "compare.seeds=1"]),
            "--out", str(out), "--tasks", "piqa,arc_easy"]
    assert main(args) == 2
    assert not out.exists()  # nothing trained, no run folder or metrics
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert line.startswith("affine-attention compare: error: cannot load the data of task piqa: dataset baber/piqa "
                           "is not in the local datasets cache; task arc_easy: dataset allenai/ai2_arc (ARC-Easy) is "
                           "not in the local datasets cache; offline mode is on (HF_DATASETS_OFFLINE=1). ")
    assert "datasets.load_dataset('baber/piqa')" in line and str(tmp_path / "datasets") in line
    assert "--include-path" in line and "fixture" not in line  # compare refuses the fixtures: never offered


def test_no_network_fails_fast_without_offline_mode(tmp_path, offline_empty_cache, monkeypatch):
    """No offline variable set but no network: the hub probe fails, so the data is looked up in the cache only."""
    import socket

    import datasets
    import huggingface_hub.constants as hub_constants

    from affine_attention.eval import TaskDataUnavailableError, harness
    from affine_attention.eval.runs import check_tasks

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    for module, attr in ((datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE"),
                         (hub_constants, "HF_HUB_OFFLINE")):
        monkeypatch.setattr(module, attr, False)
    probes = []
    monkeypatch.setattr(harness, "_hub_reachable", lambda: probes.append(1) or False, raising=False)
    connects = []

    def refuse(*args):
        connects.append(args)
        raise OSError("a test must not reach for the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    with pytest.raises(TaskDataUnavailableError) as info:
        check_tasks("arc_easy")
    assert str(info.value).startswith("cannot load the data of task arc_easy: dataset allenai/ai2_arc (ARC-Easy) "
                                      "is not in the local datasets cache; the hub (https://huggingface.co) is "
                                      "unreachable. ")
    assert probes == [1] and connects == []  # asked once, and nothing reached for the network
    assert datasets.config.HF_HUB_OFFLINE is False  # the forced offline mode was undone


def test_fixture_and_local_tasks_pass_the_data_check(tmp_path, offline_empty_cache):
    from affine_attention.eval.harness import check_task_data
    from affine_attention.eval.runs import check_tasks

    assert check_task_data("fixtures") == list(FIXTURE_TASKS)
    tasks = _local_task(tmp_path / "tasks")
    assert check_tasks("my_piqa", [str(tasks)]) == ["my_piqa"]
    (tasks / "mine.jsonl").unlink()
    with pytest.raises(ValueError, match=r"task my_piqa: dataset json: .*mine\.jsonl"):
        check_tasks("my_piqa", [str(tasks)])


@pytest.mark.slow  # 4 trainings, 4 lm-eval runs and the report: minutes on 2 cores
def test_local_tasks_reach_table_1_and_the_claims(tiny, tmp_path):
    out = tmp_path / "run"
    tasks = _local_task(tmp_path / "tasks")
    args = ["compare", "--config", "tiny", *sets(tiny + ["train.steps=2", "compare.variants=['softmax', 'affine']", "compare.seeds=2"]),
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
