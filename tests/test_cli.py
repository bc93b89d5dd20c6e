"""The `affine-attention` command as a new user meets it: the overview, --version, help text on every option with
the valid names listed, and progress on stderr during long steps."""
import argparse
import subprocess
import sys

import pytest

from affine_attention import cli


def _subparsers(parser):
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_overview_has_one_example_per_command_and_a_version(capsys):
    parser = cli.build_parser()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: affine-attention") and "Affine-Scaled Attention" in text
    assert "thin entry points" not in text  # not the module docstring
    commands = _subparsers(parser)
    examples = [line.split()[1] for line in text.splitlines() if line.strip().startswith("affine-attention ")]
    assert sorted(examples) == sorted(commands), "one example per subcommand"
    with pytest.raises(SystemExit):
        parser.parse_args(["--version"])
    from importlib.metadata import version

    assert capsys.readouterr().out.strip() == f"affine-attention {version('affine-attention')}"


def test_the_package_says_its_version_and_it_is_the_installed_one():
    """Issue 44: `affine_attention.__version__` did not exist; pyproject reads it, so the two cannot drift."""
    import affine_attention
    from importlib.metadata import version

    assert affine_attention.__version__ == version("affine-attention")
    assert cli._version() == affine_attention.__version__


def test_the_installed_command_answers_help_and_version():
    out = subprocess.run([sys.executable, "-m", "affine_attention.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("affine-attention ")


def test_every_option_has_help_and_name_options_list_the_valid_names():
    from affine_attention.hf.presets import PRESETS
    from affine_attention.train.config_load import preset_names
    from affine_attention.variants import variant_names

    commands = _subparsers(cli.build_parser())
    for name, parser in commands.items():
        for action in parser._actions:
            assert action.help, f"`{name} {'/'.join(action.option_strings) or action.dest}` has no help text"
    helps = {(name, o): a.help for name, p in commands.items() for a in p._actions for o in a.option_strings}
    assert all(p in helps[("train", "--config")] for p in preset_names()) and "tiny-ablation" in preset_names()
    assert all(p in helps[("compare", "--config")] for p in preset_names())
    assert all(p in helps[("params", "--preset")] for p in PRESETS)
    assert all(v in helps[("params", "--variant")] for v in variant_names())


def test_params_shows_progress_on_stderr(capsys):
    assert cli.main(["params", "--preset", "tiny-llama", "--preset", "tiny-qwen2", "--variant", "affine",
                     "--variant", "sink"]) == 0
    out, err = capsys.readouterr()
    assert "| tiny-llama |" in out and "| tiny-qwen2 |" in out
    # Without a terminal the progress is plain lines (a bar on a tty): the start and the end at least.
    lines = [line for line in err.splitlines() if line.startswith("building models on the meta device:")]
    assert lines[0].startswith("building models on the meta device: 0/4 models")
    assert lines[-1].startswith("building models on the meta device: 4/4 models")


def test_progress_is_a_tqdm_bar_on_a_terminal(monkeypatch, capsys):
    from affine_attention import _progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with _progress.Steps("working", 3, unit="item") as steps:
        for _ in range(3):
            steps.update()
    err = capsys.readouterr().err
    assert err.startswith("\rworking:") and "0/3 [" in err and "item/s" in err  # a tqdm bar, redrawn in place
