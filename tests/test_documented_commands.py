"""Every command the documents tell users to run is run as written (tests/documented_commands.py says by what): the
table and the documents name the same commands; the tests it names run the document's text; .ci/run runs the lines
it names; the cheap ones run here; the rest pass their own program's parser (and train / compare their --dry-run)."""
from __future__ import annotations

import argparse
import ast
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import documented
from documented_commands import CI, HOW, ByTest, Here, Parsed

REPO = documented.REPO


def test_the_table_and_the_documents_name_the_same_commands():
    found = documented.commands()
    missing = {c: [f"{ln.doc}:{ln.lineno}" for ln in lines] for c, lines in found.items() if c not in HOW}
    stale = sorted(set(HOW) - set(found))
    assert not missing, (f"documented commands nobody runs (add each to tests/documented_commands.py, saying how "
                         f"it is run as written): {missing}")
    assert not stale, f"tests/documented_commands.py names commands no document gives any more: {stale}"


def _runs(path: Path) -> set[str]:
    """The texts a test file hands to documented.command(...) (adjacent literals are one constant to ast)."""
    tree = ast.parse(path.read_text())
    return {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "documented.command"
            and node.args and isinstance(node.args[0], ast.Constant)}


@pytest.mark.parametrize("text", [c for c, how in HOW.items() if isinstance(how, ByTest)])
def test_the_named_test_runs_the_documents_text(text):
    assert text in _runs(REPO / HOW[text].path), (
        f"{HOW[text].path} must run {text!r} through documented.command(...), with the document's exact text")


def ci_lines() -> list[tuple[str, str]]:
    """The (document, selector) pairs of the `run_documented DOC 'TEXT'` calls in .ci/run."""
    return re.findall(r"^\s*run_documented (\S+) '([^']+)'", (REPO / ".ci" / "run").read_text(), re.M)


def test_ci_runs_the_lines_it_is_said_to():
    ran = set()
    for doc, selector in ci_lines():
        ran.update(documented.ci_part(doc, selector).split(" && "))
    said = {c for c, how in HOW.items() if isinstance(how, CI)}
    assert said == ran, f"said to run in CI but not run: {sorted(said - ran)}; run but not said: {sorted(ran - said)}"


def _scratch(tmp_path: Path) -> dict:
    (tmp_path / "benchmarks").symlink_to(REPO / "benchmarks")
    return dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
                HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _here(slow: bool) -> list[str]:
    docs = sorted({ln.doc for c, how in HOW.items() if isinstance(how, Here) and how.slow == slow
                   for ln in documented.commands().get(c, [])})
    return docs


def _run_here(doc: str, slow: bool, tmp_path: Path) -> None:
    env = _scratch(tmp_path)
    todo = [c for ln in documented.lines(REPO / doc) for c in ln.commands
            if isinstance(HOW.get(c), Here) and HOW[c].slow == slow]
    assert todo
    for text in todo:
        done = subprocess.run(["bash", "-c", text], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=1200)
        said = done.stdout + done.stderr
        assert done.returncode == 0, f"{doc}: `{text}` failed ({done.returncode}):\n{said[-3000:]}"
        assert HOW[text].expect in said, f"{doc}: `{text}` did not say {HOW[text].expect!r}:\n{said[-3000:]}"


@pytest.mark.parametrize("doc", _here(slow=False))
def test_the_cheap_commands_run_as_written(doc, tmp_path):
    _run_here(doc, False, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("doc", _here(slow=True))
def test_the_slow_commands_run_as_written(doc, tmp_path):
    _run_here(doc, True, tmp_path)


class _Parsed(Exception):
    pass


def _program_argv(text: str) -> tuple[str, list[str]]:
    """A command's program ('affine-attention', 'lm_eval' or a script path) and its arguments, with torchrun's and
    environment assignments' prefixes taken off (torchrun's own flags are torchrun's to check)."""
    argv = shlex.split(text)
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
        argv = argv[1:]
    if argv[0] == "torchrun":
        at = argv.index("-m")
        assert argv[at + 1] == "affine_attention.cli", text
        return "affine-attention", argv[at + 2:]
    if argv[0] in ("python", "python3"):
        return (argv[2], argv[3:]) if argv[1] == "-m" else (argv[1], argv[2:])
    return argv[0], argv[1:]


def _parse(program: str, args: list[str], monkeypatch) -> argparse.Namespace | None:
    if program == "affine-attention":
        from affine_attention.cli import build_parser

        ns = build_parser().parse_args(args)
        if getattr(ns, "config", None) or getattr(ns, "overrides", None):
            from affine_attention.train.config_load import load_config

            load_config(ns.config, ns.overrides)  # a misspelt preset or key fails here
        return ns
    if program == "lm_eval":
        from lm_eval._cli import HarnessCLI

        monkeypatch.setattr(sys, "argv", ["lm_eval", *args])
        return HarnessCLI().parse_args()
    script = REPO / program
    assert script.is_file(), f"no such script: {program}"
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, a=None, namespace=None):
        raise _Parsed(original(self, a, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.syspath_prepend(str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except _Parsed as done:
        return done.args[0]
    raise AssertionError(f"{program} ended without parsing its arguments with argparse")


@pytest.mark.parametrize("text", [c for c, how in HOW.items() if isinstance(how, Parsed)
                                  and _program_argv(c)[0] != "pytest"])
def test_commands_not_run_here_pass_their_programs_parser(text, monkeypatch):
    program, args = _program_argv(text)
    try:
        assert _parse(program, args, monkeypatch) is not None
    except SystemExit as exit_:
        pytest.fail(f"`{text}`: its parser refused it (exit {exit_.code}); see the captured stderr")


@pytest.mark.slow
@pytest.mark.parametrize("text", [c for c, how in HOW.items() if isinstance(how, Parsed)
                                  and _program_argv(c)[0] == "affine-attention"
                                  and _program_argv(c)[1][0] in ("train", "compare")
                                  and "--resume" not in c])  # a resume reads its run's folder: parsed only
def test_train_and_compare_commands_not_run_here_pass_their_dry_run(text):
    from test_train_helpers import cli_in_process

    args = _program_argv(text)[1]
    done = cli_in_process([*args, "--dry-run"])
    assert done.returncode == 0, f"`{text} --dry-run` failed:\n{done.stderr[-3000:]}"
    assert "tokens" in done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("text", [c for c, how in HOW.items() if isinstance(how, Parsed)
                                  and _program_argv(c)[0] == "pytest"])
def test_pytest_lines_not_run_here_collect_tests(text):
    """Collecting is pytest's own check of the line's flags and marker expression, without running the tests."""
    done = subprocess.run([sys.executable, *shlex.split(text)[1:], "--collect-only", "-p", "no:cacheprovider"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"`{text} --collect-only` failed:\n{(done.stdout + done.stderr)[-3000:]}"
    count = re.search(r"(\d+)(?:/\d+)? tests? collected", done.stdout)
    assert count and int(count.group(1)) > 0, done.stdout[-2000:]
