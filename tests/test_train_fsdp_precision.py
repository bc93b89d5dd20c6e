"""FSDP2 with train.precision = "bf16": the MixedPrecisionPolicy all-gathers half the bytes of fp32 parameters per
micro-batch (counted on CPU gloo by benchmarks/bench_fsdp.py), the sharded master weights the optimizer steps and
their gradients stay fp32, and the loss stays close to fp32's. Two torchrun processes (~25 s): slow suite."""
from __future__ import annotations

import json

import pytest
from test_train_helpers import REPO
from torchrun_helpers import torchrun


@pytest.mark.slow
def test_bf16_fsdp_all_gathers_half_the_bytes_and_keeps_fp32_masters():
    out = torchrun([str(REPO / "benchmarks" / "bench_fsdp.py"), "--json", "--hidden", "64", "--layers", "2",
                    "--vocab", "512", "--seq", "16"], pythonpath=[str(REPO)])
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["fp32"]["bytes"] > 0
    assert res["ratio"] == 0.5, res
    for prec in ("fp32", "bf16"):
        assert res[prec]["master_dtypes"] == ["torch.float32"] and res[prec]["grad_dtypes"] == ["torch.float32"]
    assert abs(res["bf16"]["loss"] - res["fp32"]["loss"]) < 0.05  # bf16 compute, same model and batch
