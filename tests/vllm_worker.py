"""Runs vLLM on one checkpoint in its own process (one engine per process: vLLM keeps process-wide state) and prints
JSON: per mode, the greedy tokens and their logprobs, plus the prefix-cache hits. Used by tests/test_vllm.py.

usage: python vllm_worker.py JOB_JSON   (JOB_JSON: {"max_tokens": n, "modes": {mode: [[prompt]]}, "dirs": [dir]},
                                         optionally "tensor_parallel_size": P, "dtype": the model dtype (default
                                         float32), "sink_heads_limit": n (CPU_ATTN's declared limit on query heads
                                         with sinks lowered to n in this process, to see the refusal at load))
Per checkpoint folder one engine, one after the other in this process (importing vLLM once); the modes run in order
on it, the prompts of a mode in one `generate` call (one batch), then the sink tensors vLLM's attention holds are
read ("sinks"). Prints one line "RESULT <json>" per folder."""
from __future__ import annotations

import json
import os
import sys


def engine(directory: str, tensor_parallel_size: int = 1, dtype: str = "float32"):
    from vllm import LLM

    # Small on purpose: 16-token steps force chunked prefill on every longer prompt and mix prefill chunks with
    # decodes in one step; 32-token blocks let a 64-token shared prefix hit the prefix cache.
    return LLM(model=directory, dtype=dtype, enforce_eager=True, max_model_len=128, block_size=32,
               max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=True, seed=0,
               gpu_memory_utilization=0.05, kv_cache_memory_bytes=64 << 20, disable_log_stats=False,
               tensor_parallel_size=tensor_parallel_size)


def prefix_hits(llm) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")


def sink_tensors(model) -> list[dict]:
    """Per layer with sinks: the plugin's sink tensor and the one vLLM's attention implementation reads (s_aux)."""
    from affine_attention.serving.vllm_model import VariantAttention

    return [{"layer": name, "backend": m.inner.attn_backend.get_name(), "dtype": str(m.sink_logits.dtype),
             "impl_dtype": str(m.inner.impl.sinks.dtype), "same_tensor": m.inner.impl.sinks is m.sink_logits,
             "values": m.sink_logits.float().tolist()}
            for name, m in model.named_modules() if isinstance(m, VariantAttention) and m.sink_logits is not None]


def run(directory: str, job: dict) -> dict:
    from vllm import SamplingParams

    llm = engine(directory, job.get("tensor_parallel_size", 1), job.get("dtype", "float32"))
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], logprobs=0, ignore_eos=True)
    result = {}
    for mode, prompts in job["modes"].items():
        before = prefix_hits(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        result[mode] = {"outputs": [
            {"tokens": list(o.outputs[0].token_ids),
             "logprobs": [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
            for o in outs], "prefix_hits": prefix_hits(llm) - before}
    result["sinks"] = llm.apply_model(sink_tensors)
    return result


def main(job: dict) -> None:
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    if "sink_heads_limit" in job:
        from affine_attention.serving import vllm_sinks

        cpu = vllm_sinks.SINK_SUPPORT["CPU_ATTN"]
        vllm_sinks.SINK_SUPPORT["CPU_ATTN"] = cpu._replace(max_query_heads=job["sink_heads_limit"])

    for directory in job["dirs"]:
        try:
            out = {"dir": directory, "result": run(directory, job)}
        except Exception as err:  # reported per folder: a refusal is an expected result of some tests
            out = {"dir": directory, "error": f"{type(err).__name__}: {err}"}
        gc.collect()
        cleanup_dist_env_and_memory()
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: faster to start
    main(json.loads(sys.argv[1]))
