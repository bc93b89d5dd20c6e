"""Local architecture presets (no Hub access): the paper's three student shapes, SmolLM2-135M, and tiny/small
models for tests and quick runs; plus the parameter overhead each variant adds to them.

A preset is a plain config dict (with "model_type"); `build_model` instantiates it, on the meta device by default,
so paper-size shapes cost no memory.
"""
from __future__ import annotations

import copy
from typing import Any

from .families import FAMILIES

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192}


def _llama32(**sizes) -> dict[str, Any]:
    """The Llama 3.2 family: GQA with 8 KV heads, Llama 3 RoPE, tied embeddings; `sizes` set the rest."""
    return {"model_type": "llama", "intermediate_size": 8192, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": dict(_LLAMA3_ROPE), "tie_word_embeddings": True, "hidden_act": "silu",
            "bos_token_id": 128000, "eos_token_id": 128001, **sizes}


PRESETS: dict[str, dict[str, Any]] = {
    # Qwen1.5-0.5B (the paper's 0.5B student): Qwen2 architecture, MHA, q/k/v biases, tied embeddings.
    "qwen1.5-0.5b": {
        "model_type": "qwen2", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151643},
    # Llama-3.2-1B and Llama-3.2-3B (the paper's 1B and 3B students).
    "llama-3.2-1b": _llama32(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, head_dim=64),
    "llama-3.2-3b": _llama32(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128),
    # SmolLM2-135M (the offline real model's shape; Llama architecture).
    "smollm2-135m": {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True, "hidden_act": "silu"},
    # A small model for benchmarks and quick runs (~6M parameters).
    "small-llama": {
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 16384,
        "tie_word_embeddings": True},
    # Tiny models for tests, one per supported family ("tiny-<family>", from the family table).
    **{f"tiny-{f.name}": {"model_type": f.model_type, **f.tiny} for f in FAMILIES.values()},
}

PAPER_PRESETS = ("qwen1.5-0.5b", "llama-3.2-1b", "llama-3.2-3b")


def preset_config(name: str, **overrides):
    """The transformers config of preset `name`, with `overrides` applied (e.g. num_hidden_layers=1)."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    values = {**copy.deepcopy(PRESETS[name]), **overrides}  # rows hold lists (layer_types) shared with the table
    return AutoConfig.for_model(values.pop("model_type"), **values)


def build_model(name: str, variant: str | None = None, *, device: str = "meta", dtype=None, **overrides):
    """A freshly initialised causal LM of preset `name` (on the meta device unless told otherwise), converted to
    `variant` when given. Overrides change config fields."""
    import torch
    from transformers import AutoModelForCausalLM

    from .convert import convert

    config = preset_config(name, **overrides)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype) if dtype else \
            AutoModelForCausalLM.from_config(config)
    return convert(model, variant) if variant is not None else model


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields tied weights once


def parameter_overheads(preset: str, variants: list[str], done=None) -> tuple[int, dict[str, int]]:
    """(base parameters of `preset`, {variant: trainable parameters it adds}), building the meta model once.
    done: called with no argument after each variant (progress of a long table)."""
    import copy

    from .convert import convert

    base = build_model(preset)
    before = _count(base)
    extra = {}
    for v in variants:
        extra[v] = _count(convert(copy.deepcopy(base), v)) - before
        if done is not None:
            done()
    return before, extra


def parameter_overhead(preset: str, variant: str) -> int:
    """Trainable parameters `variant` (default options) adds to preset `preset`; buffers such as alpha_ma are
    not parameters, so softmax and off_by_one add 0."""
    return parameter_overheads(preset, [variant])[1][variant]
