"""How exactly each model family converts: max |logit difference| between the unconverted tiny model (transformers'
eager attention) and its conversion to every variant with function_preserving=True (softmax: a plain conversion),
left-padded batch, float32. A refused pair prints its reason's first words. Prints a markdown table.

    python benchmarks/family_exactness.py
"""
from __future__ import annotations

import copy

import torch

import affine_attention
from affine_attention.hf.families import FAMILIES, refusal
from affine_attention.hf.presets import build_model
from affine_attention.variants import variant_names


def main() -> None:
    variants = variant_names()
    print("| family | " + " | ".join(variants) + " |")
    print("|---|" + "---:|" * len(variants))
    for family in FAMILIES:
        torch.manual_seed(0)
        base = build_model(f"tiny-{family}", device="cpu").eval()
        base.set_attn_implementation("eager")
        ids = torch.randint(3, base.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        mask[2, :1] = 0
        with torch.no_grad():
            want = base(ids, attention_mask=mask).logits
        cells = []
        for variant in variants:
            why = refusal(family, variant)
            if why:
                cells.append("refused")
                continue
            try:
                model = affine_attention.convert(copy.deepcopy(base), variant,
                                                 function_preserving=variant != "softmax")
            except ValueError:
                cells.append("no retrofit")
                continue
            with torch.no_grad():
                got = model(ids, attention_mask=mask).logits
            cells.append(f"{(got - want)[mask.bool()].abs().max().item():.1e}")
        print(f"| {family} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
