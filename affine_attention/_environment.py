"""What a run was measured on (hardware, library versions): recorded by `compare`, shown by reports and benchmarks."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def versions() -> dict[str, str]:
    import importlib.metadata as md

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("transformers", "affine-attention"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed (source tree)"
    return out


def hardware() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    gpu = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) or "none"
    return f"CPU {cpu}, {cores} usable cores; GPU: {gpu}"
