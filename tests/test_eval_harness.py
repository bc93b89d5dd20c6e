"""affine_attention.eval.harness: the real lm-evaluation-harness, offline, on the fixture tasks."""

import json
import math
from pathlib import Path

import pytest
import torch

from affine_attention.eval import (
    FIXTURE_PPL_TASK,
    FIXTURE_TASKS,
    PAPER_TASKS,
    TaskDataUnavailableError,
    evaluate,
    expand_tasks,
    format_table,
    materialize_fixture_tasks,
    write_results,
)
from affine_attention.text.corpus import default_tokenizer as make_tokenizer  # the packaged one

FIXTURES = Path(__file__).resolve().parents[1] / "affine_attention" / "eval" / "fixtures"
LIMIT = 6

# Field names and value types of the HF data sets lm-eval reads for each paper task.
SCHEMAS = {
    "arc_easy": {"id": str, "question": str, "choices": dict, "answerKey": str},
    "arc_challenge": {"id": str, "question": str, "choices": dict, "answerKey": str},
    "hellaswag": {
        "ind": int, "activity_label": str, "ctx_a": str, "ctx_b": str, "ctx": str, "endings": list,
        "source_id": str, "split": str, "split_type": str, "label": str,
    },
    "piqa": {"goal": str, "sol1": str, "sol2": str, "label": int},
    "boolq": {"question": str, "passage": str, "idx": int, "label": int},
    "winogrande": {"sentence": str, "option1": str, "option2": str, "answer": str},
    "c4": {"text": str, "timestamp": str, "url": str},
}


def make_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=len(tokenizer),
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    """A tiny Llama converted to Affine-Scaled Attention, alpha away from its init: the harness must run it."""
    import affine_attention

    m = affine_attention.convert(make_model(tok), "affine")
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "alpha_proj" in name:
                p.normal_(0.0, 0.5)
    return m


@pytest.fixture(scope="module")
def fixture_results(model, tok):
    model.train()  # evaluate must switch to eval mode for the run and restore this afterwards
    results = evaluate(model, tok, ["fixtures"], offline=True, limit=LIMIT, batch_size=4)
    assert model.training
    return results


def rows(name):
    path = FIXTURES / "data" / f"{name}.fixture.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_fixture_files_use_the_real_schema(name):
    data = rows(name)
    assert 16 <= len(data) <= 40 if name == "c4" else 24 <= len(data) <= 40
    for row in data:
        assert {k: type(v) for k, v in row.items()} == SCHEMAS[name], row
    if name.startswith("arc"):
        for row in data:
            assert set(row["choices"]) == {"text", "label"}
            assert len(row["choices"]["text"]) == len(row["choices"]["label"]) >= 3
            assert row["answerKey"] in row["choices"]["label"]
            assert row["id"].startswith("fixture_")
    if name == "hellaswag":
        assert all(len(r["endings"]) == 4 and r["label"] in "0123" and "fixture" in r["source_id"] for r in data)
    if name == "winogrande":
        assert all(r["sentence"].count("_") == 1 and r["answer"] in ("1", "2") for r in data)
    if name in ("piqa", "boolq"):
        assert {r["label"] for r in data} == {0, 1}


def test_fixture_tasks_reuse_the_real_prompt_formats(tmp_path):
    import lm_eval
    from lm_eval.tasks._yaml_loader import load_yaml

    folder = materialize_fixture_tasks(tmp_path)
    real_dir = Path(lm_eval.__file__).parent / "tasks"
    real_files = {
        "arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
        "hellaswag": "hellaswag/hellaswag.yaml", "piqa": "piqa/piqa.yaml",
        "boolq": "super_glue/boolq/default.yaml", "winogrande": "winogrande/default.yaml",
    }
    assert set(real_files) == set(PAPER_TASKS)
    for name, rel in real_files.items():
        ours = load_yaml(folder / f"fixture_{name}.yaml", resolve_func=False)
        real = load_yaml(real_dir / rel, resolve_func=False)
        for key in ("output_type", "doc_to_text", "doc_to_target", "doc_to_choice", "process_docs", "metric_list"):
            assert ours.get(key) == real.get(key), (name, key)
        assert ours["task"] == f"fixture_{name}" and ours["dataset_path"] == "json"
        (split, path), = ours["dataset_kwargs"]["data_files"].items()
        assert Path(path).is_absolute() and Path(path).is_file() and "fixture" in Path(path).name
        assert split == (real.get("test_split") or real["validation_split"])  # the split lm-eval scores


def test_all_fixture_tasks_run_offline(fixture_results):
    tasks = fixture_results["tasks"]
    assert set(tasks) == set(FIXTURE_TASKS)
    for name in FIXTURE_TASKS:
        entry = tasks[name]
        assert entry["samples"] == LIMIT
        if name == FIXTURE_PPL_TASK:
            for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
                assert math.isfinite(entry[metric]) and entry[metric] > 0
            assert entry["byte_perplexity"] > 1
            continue
        metrics = ["acc"] + (["acc_norm"] if name not in ("fixture_boolq", "fixture_winogrande") else [])
        for metric in metrics:
            assert 0.0 <= entry[metric] <= 1.0
            assert entry[f"{metric}_stderr"] >= 0.0
    assert fixture_results["config"]["offline"] is True
    assert fixture_results["config"]["fixture_tasks_used"] == list(FIXTURE_TASKS)


def test_results_are_deterministic(model, tok, fixture_results):
    torch.manual_seed(5)
    expected_draw = torch.rand(3)
    torch.manual_seed(5)
    again = evaluate(model, tok, ["fixture_piqa", "fixture_c4"], offline=True, limit=LIMIT, batch_size=2)
    assert torch.equal(torch.rand(3), expected_draw)  # lm-eval's reseeding does not leak out
    for name in ("fixture_piqa", "fixture_c4"):
        for metric, value in again["tasks"][name].items():
            expected = fixture_results["tasks"][name][metric]
            if expected is None:  # lm-eval reports no stderr for some aggregations
                assert value is None, (name, metric)
                continue
            assert value == pytest.approx(expected, rel=1e-6), (name, metric)


def test_write_results(fixture_results, tmp_path):
    json_path, md_path = write_results(fixture_results, tmp_path / "out")
    assert json.loads(json_path.read_text()) == fixture_results
    table = md_path.read_text()
    assert all(name in table for name in FIXTURE_TASKS) and "not a benchmark" in table
    assert table == format_table(fixture_results)
    json_path, md_path = write_results(fixture_results, tmp_path / "named.json")
    assert json_path.name == "named.json" and md_path.name == "named.md"


def test_user_task_folder(model, tok, tmp_path):
    fixtures = materialize_fixture_tasks(tmp_path / "fixtures")
    user = tmp_path / "user"
    user.mkdir()
    (user / "my_piqa.yaml").write_text(f"include: {json.dumps(str(fixtures / 'fixture_piqa.yaml'))}\ntask: my_piqa\n")
    results = evaluate(model, tok, "my_piqa", include_path=user, offline=True, limit=3)
    assert results["tasks"]["my_piqa"]["samples"] == 3
    assert 0.0 <= results["tasks"]["my_piqa"]["acc"] <= 1.0


def test_paper_tasks_offline_fail_clearly(model, tok, tmp_path, monkeypatch):
    import datasets
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Empty caches, so the test means the same on a machine that did download the data once.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    saved = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    with pytest.raises(TaskDataUnavailableError) as info:
        evaluate(model, tok, ["fixture_piqa", "arc_easy"], limit=2)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert message.startswith("cannot load the data of task arc_easy: dataset allenai/ai2_arc (ARC-Easy) is not in "
                              "the local datasets cache; offline mode is on (HF_DATASETS_OFFLINE=1). ")
    assert "fixture_arc_easy" in message and "\n" not in message
    assert "include_path" in message
    assert (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE) == saved  # offline switch undone


def test_unknown_task_and_bad_arguments(model, tok):
    with pytest.raises(ValueError, match="fixture_piqq.*did you mean fixture_piqa"):
        evaluate(model, tok, ["fixture_piqq"], offline=True)
    with pytest.raises(ValueError, match="batch_size"):
        evaluate(model, tok, ["fixture_piqa"], batch_size=0)
    with pytest.raises(ValueError, match="not a folder"):
        evaluate(model, tok, ["fixture_piqa"], include_path="/nonexistent/tasks")


def test_expand_tasks():
    assert expand_tasks("fixtures") == list(FIXTURE_TASKS)
    assert expand_tasks(["paper"]) == list(PAPER_TASKS)
    assert expand_tasks("arc_easy, piqa,arc_easy") == ["arc_easy", "piqa"]
    with pytest.raises(ValueError, match="no tasks"):
        expand_tasks(" , ")


@pytest.mark.slow
def test_full_fixture_run_scores_every_item(model, tok):
    results = evaluate(model, tok, FIXTURE_TASKS, offline=True)
    for name in FIXTURE_TASKS:
        assert results["tasks"][name]["samples"] == len(rows(name.removeprefix("fixture_")))
