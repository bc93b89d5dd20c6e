"""Tiny converted fp32 checkpoints for the vLLM tests and benchmark: one per (family, variant), with every variant
weight random (zero-initialised weights would make alpha and the gates constants that hide a wrong combine), and
what transformers' generate produces with them (the reference vLLM must match)."""
from __future__ import annotations

import os
import shutil
from importlib import resources

import torch

#: head_dim 32: the smallest vLLM's CPU attention takes. Mistral's window (6) is shorter than the prompts.
FAMILY_CONFIGS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 6},
}
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 4096, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0}


def copy_tokenizer(directory: str) -> None:
    """The package's own tokenizer (vocabulary 4096), so vLLM and the OpenAI server can tokenize offline."""
    src = resources.files("affine_attention") / "data" / "tokenizer"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        with resources.as_file(src / name) as path:
            shutil.copy(path, os.path.join(directory, name))


def make_checkpoint(directory: str, family: str, variant: str | None, *, seed: int = 0, sizes=None, options=None):
    """Save a random fp32 `family` model, converted to `variant` (None: unconverted), with random variant weights
    (alpha_ma in (0.2, 0.8), sinks ~ N(0, 0.5)); options: the variant's. Returns the transformers model (eval mode)."""
    import affine_attention
    from affine_attention.hf.families import get_family
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    values = {**TINY, **FAMILY_CONFIGS.get(family, {}), **(sizes or {})}
    config = AutoConfig.for_model(get_family(family).model_type, **values)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if variant is not None:
        affine_attention.convert(model, variant, **(options or {}))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".attn_variant." in name:
                    p.copy_(torch.randn_like(p) * (0.5 if name.endswith("sinks") else 0.2))
            for name, b in model.named_buffers():
                if name.endswith(".alpha_ma"):
                    b.copy_(torch.rand_like(b) * 0.6 + 0.2)
    model.eval()
    model.save_pretrained(directory)
    copy_tokenizer(directory)
    return model


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int):
    """transformers' greedy generate, one prompt at a time: (tokens, logprob of each chosen token) per prompt."""
    results = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(s[0].double(), -1)[t].item() for s, t in zip(out.scores, tokens)]
        results.append((tokens, logprobs))
    return results
