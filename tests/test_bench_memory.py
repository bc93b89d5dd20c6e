"""The benchmarks' live-tensor peak on the CPU (benchmarks/common.allocator_peak_bytes) counts the bytes of live
tensors: each allocation once, however deeply the op that made it nests (linear > matmul > mm), freed blocks not at
all."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import allocator_peak_bytes  # noqa: E402

X, W = torch.randn(1000, 50), torch.randn(1000, 50)
OUT = 1000 * 1000 * 4  # bytes of one (1000, 1000) float32 result


def test_nested_ops_count_each_allocation_once():
    def two_live():
        y = F.linear(X, W)  # aten::linear > matmul > mm: one allocation
        z = y.exp()
        return z.shape, y.shape  # both alive until here

    peak = allocator_peak_bytes(two_live)
    assert 2 * OUT <= peak < 2 * OUT + 4096, peak


def test_a_freed_tensor_no_longer_counts():
    def one_at_a_time():
        for _ in range(3):
            F.linear(X, W)  # dropped at once

    peak = allocator_peak_bytes(one_at_a_time)
    assert OUT <= peak < OUT + 4096, peak
