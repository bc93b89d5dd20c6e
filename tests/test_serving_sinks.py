"""The vLLM plugin's table of what each attention backend takes as sinks (serving/vllm_sinks.py) and the choice made
from it, without vLLM: the sink dtype for each model dtype, and the refusal beyond a head limit or for a backend the
table does not know, naming backend, dtype and head count. The engine side is tests/test_vllm_sinks.py."""
import pytest
import torch

from affine_attention.serving.vllm_sinks import SINK_SUPPORT, Refused, backend_key, sink_dtype

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("key,model,want", [
    ("FLASH_ATTN/FA3", BF16, BF16), ("FLASH_ATTN/FA3", FP16, BF16),  # s_aux only in bfloat16 (hopper/flash_api.cpp)
    ("FLASH_ATTN/FA4", BF16, BF16), ("FLASH_ATTN/FA4", FP16, BF16),
    ("CPU_ATTN", BF16, BF16), ("CPU_ATTN", FP32, FP32), ("CPU_ATTN", FP16, FP32),
    ("TRITON_ATTN", BF16, BF16), ("TRITON_ATTN", FP16, FP16), ("TRITON_ATTN", FP32, FP32),
    ("FLASHINFER", BF16, FP32), ("FLASHINFER", FP16, FP32),
])
def test_sinks_go_in_the_dtype_the_backend_takes(key, model, want):
    assert sink_dtype(key, model, 8) == want


def test_flash_attention_3_takes_sinks_with_at_most_64_query_heads():
    assert sink_dtype("FLASH_ATTN/FA3", BF16, 64) == BF16
    with pytest.raises(Refused) as e:
        sink_dtype("FLASH_ATTN/FA3", FP16, 65)  # e.g. 52 query heads + 13 zero heads of the mean of V on one rank
    message = str(e.value)
    for part in ("FLASH_ATTN/FA3", "(bfloat16)", "at most 64 query heads", "this layer has 65", "tensor_parallel_size",
                 "--attention-backend TRITON_ATTN"):
        assert part in message, (part, message)
    assert sink_dtype("FLASH_ATTN/FA4", BF16, 128) == BF16 and sink_dtype("TRITON_ATTN", BF16, 128) == BF16


def test_a_backend_without_declared_sinks_is_refused():
    for key in ("FLASH_ATTN/FA2", "ROCM_ATTN", "FLEX_ATTENTION"):
        with pytest.raises(Refused, match=f"backend {key} for this bfloat16 model") as e:
            sink_dtype(key, BF16, 4)
        assert "--attention-backend" in str(e.value)


def test_backend_keys_and_sources():
    assert backend_key("FLASH_ATTN", 3) == "FLASH_ATTN/FA3"
    assert backend_key("CPU_ATTN", None) == backend_key("CPU_ATTN", 3) == "CPU_ATTN"
    for key, support in SINK_SUPPORT.items():
        assert support.source and (support.dtypes is None or all(d.is_floating_point for d in support.dtypes)), key
