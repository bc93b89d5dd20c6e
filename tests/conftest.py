"""Shared test helpers: deterministic float64 inputs in the SDPA layout."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_qkv(B, Hq, Hkv, T, S, D, dtype=torch.float64, requires_grad=True):
    """q: (B, Hq, T, D), k, v: (B, Hkv, S, D)."""
    q = torch.randn(B, Hq, T, D, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(B, Hkv, S, D, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(B, Hkv, S, D, dtype=dtype, requires_grad=requires_grad)
    return q, k, v
