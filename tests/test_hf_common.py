"""Helpers shared by the tests/test_hf_*.py files: tiny models per family, trained-looking variant state, batches."""
from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("transformers")

import affine_attention  # noqa: E402,F401  (registers the converted model types)
from affine_attention.hf.families import family_names, refusal  # noqa: E402
from affine_attention.hf.presets import build_model  # noqa: E402

# transformers 5.24 renamed the forward argument `past_key_values` to `cache` (the old name still works there, with
# a deprecation warning); tests pass a cache under the name the installed version takes: model(ids, **{CACHE: c}).
from transformers import LlamaForCausalLM as _Llama  # noqa: E402

CACHE = "cache" if "cache" in inspect.signature(_Llama.forward).parameters else "past_key_values"

# Every family of the table; the tiny presets of mistral, gemma2, gemma3, mixtral and gpt_oss have a 4-token window.
FAMILIES = family_names(core=True)  # the per-family files; tests/test_families_enumerated.py checks the rest
VOCAB = 128


def capped(model) -> bool:
    """Whether the model caps its attention logits (Gemma 2). transformers' own sdpa cannot: 5.17 drops the cap
    silently, 5.24 refuses; only its eager attention is a reference for such a model."""
    return getattr(model.config, "attn_logit_softcapping", None) is not None


def richest(family: str) -> str:
    """The variant with the most new state that `family` converts to: affine_gated (alpha_proj, gate_proj, alpha_ma),
    or gated where the family refuses the affine variants (GPT-OSS, whose attention has sinks of its own)."""
    return "gated" if refusal(family, "affine_gated") else "affine_gated"


def tiny(family: str, variant: str | None = None, *, seed: int = 0, dtype=None, **overrides):
    """A freshly initialised tiny causal LM (hidden 64, 2 layers, 4 heads, 2 KV heads) in eval mode on CPU."""
    torch.manual_seed(seed)
    model = build_model(f"tiny-{family}", device="cpu", dtype=dtype, **overrides).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early, so sequences line up
    if variant is None and capped(model):
        model.set_attn_implementation("eager")  # the reference: transformers' sdpa cannot cap (see `capped`)
    if variant is not None:
        affine_attention.convert(model, variant)
    return model


@torch.no_grad()
def perturb(model, seed: int = 1) -> None:
    """Give every variant parameter and alpha_ma a non-initial value, so identity or defaults would be detectable."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if ".attn_variant." in name:
            p.copy_(0.3 * torch.randn(p.shape, generator=gen).to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("alpha_ma"):
            b.copy_(torch.rand(b.shape, generator=gen).to(b.dtype))


def variant_state(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if ".attn_variant." in k}


def left_padded(B: int = 3, T: int = 12, pads=(0, 3, 1), seed: int = 0):
    """input_ids (B, T), attention_mask (B, T) with left padding `pads`, and matching position_ids (B, T)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    for b, p in enumerate(pads[:B]):
        mask[b, :p] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos
