"""`affine-attention eval --write-tasks DIR`: the fixture tasks as files lm-eval's own task loading and command line
read as they are (the shipped YAMLs are templates with placeholders, which lm-eval skips as "not found")."""

import json
import os
import subprocess
import sys
from pathlib import Path

import documented
import pytest

from test_eval_cli import model_dir  # noqa: F401  (fixture: a saved tiny Llama with the packaged tokenizer)

from affine_attention.cli import main
from affine_attention.eval import FIXTURE_TASKS

DATA = Path(__file__).resolve().parents[1] / "affine_attention" / "eval" / "fixtures" / "data"


def rows(task: str) -> list[dict]:
    path = DATA / f"{task.removeprefix('fixture_')}.fixture.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("written") / "fixture_tasks"
    assert main(["eval", "--write-tasks", str(folder)]) == 0
    return folder


def test_written_tasks_load_in_lm_evals_task_manager(written):
    from lm_eval.tasks import TaskManager

    # As `lm_eval --include_path DIR` does (built-in tasks left out only to keep the test short).
    manager = TaskManager(include_path=str(written), include_defaults=False)
    assert set(FIXTURE_TASKS) <= set(manager.all_tasks)
    for name in FIXTURE_TASKS:
        task = manager.load([name])["tasks"][name]
        expected = rows(name)
        split = task.config.test_split or task.config.validation_split
        assert task.dataset[split].num_rows == len(expected), name
        assert len(task.eval_docs) == len(expected), name
        first_field = next(iter(expected[0]))
        assert task.dataset[split][0][first_field] == expected[0][first_field], name
    piqa = manager.load(["fixture_piqa"])["tasks"]["fixture_piqa"]
    first = rows("fixture_piqa")[0]
    # lm-eval's own piqa prompt and answer on the fixture's first item.
    assert piqa.doc_to_text(piqa.eval_docs[0]) == f"Question: {first['goal']}\nAnswer:"
    assert piqa.doc_to_target(piqa.eval_docs[0]) == first["label"]


def test_write_tasks_prints_the_command_and_refuses_bad_use(written, tmp_path, capsys):
    folder = tmp_path / "tasks"
    assert main(["eval", "--write-tasks", str(folder)]) == 0
    assert f"--include_path {folder.resolve()} --tasks fixture_piqa" in capsys.readouterr().out
    assert sorted(p.name for p in folder.glob("*.yaml")) == sorted(f"{name}.yaml" for name in FIXTURE_TASKS)
    assert main(["eval", "--write-tasks", str(folder)]) == 2  # not empty now: nothing is replaced
    assert "is not empty; give a new or empty folder" in capsys.readouterr().err
    assert main(["eval", "--write-tasks", str(tmp_path / "t2"), "--model", "m"]) == 2
    assert "run it without --model" in capsys.readouterr().err
    assert main(["eval", "--tasks", "fixtures"]) == 2
    assert "--model is required" in capsys.readouterr().err


def test_lm_evals_own_command_runs_the_written_tasks(written, model_dir, tmp_path):  # noqa: F811
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model_dir}",
                    "--include_path", str(written), "--tasks", "fixture_piqa,fixture_arc_easy", "--limit", "4",
                    "--batch_size", "4", "--device", "cpu", "--output_path", str(out)],
                   env=env, cwd=tmp_path, check=True, capture_output=True, timeout=300)
    (result,) = out.rglob("results_*.json")
    raw = json.loads(result.read_text())
    for name in ("fixture_piqa", "fixture_arc_easy"):
        assert raw["n-samples"][name] == {"original": len(rows(name)), "effective": 4}
        assert 0.0 <= raw["results"][name]["acc,none"] <= 1.0


# The README's text, read from the README (fails when the README changes it).
README_WRITE_TASKS = documented.command("affine-attention eval --write-tasks runs/fixture_tasks")


def test_the_readmes_write_tasks_command_leaves_nothing_in_the_repository_root(tmp_path, monkeypatch):
    """Run from a clone's root, the README's command writes into runs/, which the repository ignores."""
    import shlex

    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(README_WRITE_TASKS)[1:]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]
    assert {f"{t}.yaml" for t in FIXTURE_TASKS} <= {p.name for p in (tmp_path / "runs" / "fixture_tasks").iterdir()}
    ignored = (Path(__file__).resolve().parents[1] / ".gitignore").read_text().splitlines()
    assert "runs/" in ignored
