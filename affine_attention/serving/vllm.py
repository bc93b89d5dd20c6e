"""The vLLM plugin: vLLM calls `register` in every process it starts (entry point `vllm.general_plugins`), which
registers the converted architectures (`Affine<Family>ForCausalLM`) with vLLM's model registry.

Families whose vLLM model this plugin extends (SERVED) get the model class of serving/vllm_model.py; every other
family of hf/families.py gets a class that refuses to start, saying why, so a converted checkpoint never reaches
vLLM's generic fallback (which would run plain softmax attention).
"""
from __future__ import annotations

#: family (hf/families.py) -> (vLLM module under vllm.model_executor.models, its causal-LM class), the class the
#: converted model extends. The attention module of each has `.attn` (vLLM's Attention) fed q (N, Hq*D) and
#: k, v (N, Hkv*D), and receives the pre-normed hidden states as `hidden_states`.
SERVED = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
}
MODEL_MODULE = "affine_attention.serving.vllm_model"


def architecture(family: str) -> str:
    """The `architectures` entry a converted checkpoint of `family` records, e.g. AffineLlamaForCausalLM (the name
    hf/models.py gives its converted class)."""
    from ..hf.families import get_family

    return f"Affine{get_family(family).model_class}"


def register() -> None:
    """Register every converted architecture with vLLM (idempotent; vLLM calls it once per process)."""
    from vllm import ModelRegistry

    from ..hf import registration
    from ..hf.families import family_names

    # vLLM reads config.json through transformers' AutoConfig: the converted model types must be known to it.
    registration.register()
    for family in family_names():
        # Lazy "module:class" strings: vLLM imports the model module only in the processes that build a model.
        ModelRegistry.register_model(architecture(family), f"{MODEL_MODULE}:{architecture(family)}")
