"""Every numeric config key declares its range where it is defined, and a value outside it (NaN, negative, zero
where a count is needed) is refused with the key, the value and the range named: from a file, from `--set`, from a
config built in code, before `--dry-run` prints a plan; `compare --seeds` likewise; a damaged result.json read on
`--resume` is a one-line error naming the file and what to do."""
from __future__ import annotations

import dataclasses
import json
import typing

import pytest

from test_train_helpers import tiny  # noqa: F401  (fixture)


def _config_classes():
    from affine_attention.train.config import RunConfig

    seen, todo = [], [RunConfig]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo += [h for h in typing.get_type_hints(cls).values() if dataclasses.is_dataclass(h)]
    return seen


def _numeric(hint) -> str | None:
    """"int" / "float" for an integer / number (or list of them) field, else None."""
    hint = typing.get_args(hint)[0] if typing.get_origin(hint) is list else hint
    return {int: "int", float: "float"}.get(hint)


def test_every_numeric_field_of_every_config_table_declares_its_range():
    classes = _config_classes()
    assert len(classes) == 11  # RunConfig, its eight tables, SourceConfig and BackcopyConfig: a new table is walked too
    numeric, missing = [], []
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = _numeric(hints[f.name])
            if kind is None:
                continue
            numeric.append(f"{cls.__name__}.{f.name}")
            declared = f.metadata.get("range")
            if declared is None or declared.integer != (kind == "int"):
                missing.append(f"{cls.__name__}.{f.name}")
    assert len(numeric) >= 35 and "ScheduleConfig.min_lr_ratio" in numeric
    assert missing == [], f"numeric config fields without a declared range of their kind: {missing}"


@pytest.mark.parametrize("override, message", [
    ("schedule.min_lr_ratio=nan", "schedule.min_lr_ratio must be finite and in [0, 1], got nan"),
    ("schedule.min_lr_ratio=-0.5", "schedule.min_lr_ratio must be finite and in [0, 1], got -0.5"),
    ("schedule.decay_fraction=nan", "schedule.decay_fraction must be finite and in [0, 1], got nan"),
    ("schedule.warmup_steps=-1", "schedule.warmup_steps must be positive or 0, got -1"),
    ("model.rope_theta=nan", "model.rope_theta must be finite and > 0, got nan"),
    ("model.rope_theta=-10000.0", "model.rope_theta must be finite and > 0, got -10000.0"),
    ("model.rms_norm_eps=nan", "model.rms_norm_eps must be finite and > 0, got nan"),
    ("model.rms_norm_eps=-1e-6", "model.rms_norm_eps must be finite and > 0, got -1e-06"),
    ("model.initializer_range=inf", "model.initializer_range must be finite and > 0, got inf"),
    ("kd.temperature=nan", "kd.temperature must be finite and > 0, got nan"),
    ("kd.temperature=-2.0", "kd.temperature must be finite and > 0, got -2.0"),
    ("kd.kd_alpha=1.5", "kd.kd_alpha must be finite and in [0, 1], got 1.5"),
    ("data.eval_sequences=0", "data.eval_sequences must be positive, got 0"),
    ("data.probe_sequences=-1", "data.probe_sequences must be positive, got -1"),
    ("train.threads=-4", "train.threads must be positive or 0 (0 keeps torch's default), got -4"),
    ("train.seed=-1", "train.seed must be in [0, 4294967295], got -1"),
    ("train.log_every=0", "train.log_every must be positive, got 0"),
    ("kd.cache_shard_sequences=0", "kd.cache_shard_sequences must be positive, got 0"),
    ("optim.betas=[0.9]", "optim.betas must be two numbers in [0, 1), got [0.9]"),
])
def test_out_of_range_values_are_refused_with_key_value_and_range(override, message):
    from affine_attention.train.config_load import load_config

    with pytest.raises(ValueError) as err:
        load_config("tiny", [override])
    assert str(err.value).endswith("tiny.toml: " + message)


def test_dry_run_refuses_a_bad_value_instead_of_printing_a_plan(capsys):
    from affine_attention.cli import main

    assert main(["train", "--dry-run", "--set", "model.rope_theta=nan"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().endswith("model.rope_theta must be finite and > 0, got nan")
    assert main(["train", "--dry-run", "--world", "0"]) == 2
    assert capsys.readouterr().err.strip().endswith("--world must be positive, got 0")


def test_a_config_built_in_code_is_checked_before_anything_is_written(tiny, tmp_path):
    from affine_attention.train.config_load import load_config
    from affine_attention.train.loop import train

    cfg = load_config("tiny", tiny + ["train.steps=2"])
    bad = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, min_lr_ratio=float("nan")))
    with pytest.raises(ValueError, match=r"^schedule.min_lr_ratio must be finite and in \[0, 1\], got nan$"):
        train(bad, tmp_path / "run", log=lambda m: None)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("seeds", [0, -1])
def test_compare_seeds_must_be_at_least_one(tiny, tmp_path, seeds):
    from affine_attention.train.compare import compare
    from affine_attention.train.config_load import load_config

    cfg = load_config("tiny", tiny + ["train.steps=1", "compare.variants=['softmax']"])
    with pytest.raises(ValueError, match=rf"^--seeds must be positive, got {seeds}$"):
        compare(cfg, tmp_path / "cmp", seeds=seeds, log=lambda m: None)
    assert not (tmp_path / "cmp").exists()


def test_a_damaged_result_json_on_resume_names_the_file_and_what_to_do(tiny, tmp_path):
    from affine_attention.train.compare import compare
    from affine_attention.train.config_load import load_config
    from affine_attention.train.loop import train

    cfg = load_config("tiny", tiny + ["train.steps=1", "compare.variants=['softmax']"])
    compare(cfg, tmp_path / "cmp", seeds=1, log=lambda m: None)
    result = tmp_path / "cmp" / "softmax" / "seed0" / "result.json"
    good = json.loads(result.read_text())
    result.write_text(result.read_text()[:40])  # damaged: cut short
    expected = f"{result} is damaged (not valid JSON: "
    for resume in (lambda: compare(cfg, tmp_path / "cmp", seeds=1, resume=True, log=lambda m: None),
                   lambda: train(cfg, result.parent, resume=True, variant="softmax", log=lambda m: None)):
        with pytest.raises(ValueError) as err:
            resume()
        assert str(err.value).startswith(expected) and "\n" not in str(err.value)
        assert "delete it and --resume again" in str(err.value)
    result.unlink()  # what the message says to do: the summary is rebuilt from the run's final checkpoint and log
    again = compare(cfg, tmp_path / "cmp", seeds=1, resume=True, log=lambda m: None)
    assert again["variants"]["softmax"]["heldout_loss"]["mean"] == good["heldout_loss"]
    assert json.loads(result.read_text())["heldout_loss"] == good["heldout_loss"]
