"""Shared test helpers: deterministic float64 inputs in the SDPA layout; the environment marker of each test file."""
from pathlib import Path

import pytest
import torch
from suites import VERSION_INDEPENDENT


def pytest_collection_modifyitems(config, items):
    """Mark the tests of version-independent files, which CI's second environment deselects (tests/suites.py)."""
    for item in items:
        if Path(str(item.fspath)).name in VERSION_INDEPENDENT:
            item.add_marker(pytest.mark.version_independent)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_qkv(B, Hq, Hkv, T, S, D, dtype=torch.float64, requires_grad=True):
    """q: (B, Hq, T, D), k, v: (B, Hkv, S, D)."""
    q = torch.randn(B, Hq, T, D, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(B, Hkv, S, D, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(B, Hkv, S, D, dtype=dtype, requires_grad=requires_grad)
    return q, k, v
