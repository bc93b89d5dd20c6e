"""Every public op x every mask traces under torch.compile(fullgraph=True) and equals eager (fp32, <= 1e-5) in its
forward, every gradient (q, k, v and the op's parameters) and its no_grad forward: the matrix of
benchmarks/compile_matrix.py. Default suite: every mask on affine_gated (value mean and gate together) plus each
other op on the masks that change its path; `-m exhaustive` runs the rest of the cross."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "compile_matrix", Path(__file__).resolve().parent.parent / "benchmarks" / "compile_matrix.py")
compile_matrix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compile_matrix)

# ~2.5 s a cell on two cores (one compile of forward and backward, one of the no_grad forward).
DEFAULT = {("affine_gated", m) for m in compile_matrix.MASKS} | {
    ("affine", "causal T>S"), ("affine", "keypad right"),
    ("gated", "none"), ("gated", "window=4 + keypad"),
    ("sink", "causal T<S (cache)"), ("sink", "document_ids"),
    ("softmax", "causal T<S (cache)"), ("softmax", "dense (B,1,T,S)"),
    ("off_by_one", "keypad left + causal"),
}


def _params():
    for op, mask in compile_matrix.CASES:
        marks = () if (op, mask) in DEFAULT else (pytest.mark.exhaustive,)
        yield pytest.param(op, mask, marks=marks, id=f"{op}-{mask}")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("op, mask", list(_params()))
def test_compiled_op_equals_eager(op, mask):
    cell = compile_matrix.run_cell(op, mask)
    assert cell["traced"], f"fullgraph trace failed: {cell['error']}: {cell.get('message')}"
    tol = compile_matrix.TOL
    assert not cell["zero_grads"], f"compiled gradients all zero (eager's are not): {cell['zero_grads']}"
    assert cell["fwd"] <= tol, f"forward differs from eager by {cell['fwd']:.2e}"
    bad = {n: d for n, d in cell["grads"].items() if d > tol}
    assert not bad, f"gradients differ from eager: {bad}"
    assert cell["nograd"] <= tol, f"no_grad forward differs from eager by {cell['nograd']:.2e}"


def test_the_default_cases_exist():
    assert DEFAULT <= set(compile_matrix.CASES)
