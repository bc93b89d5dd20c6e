"""Per-token latency of cached greedy decoding for every attention variant, against the unconverted transformers
"sdpa" model, at cache lengths 256..8192 on a small model; variants interleaved in a shuffled order per repeat,
medians of paired ratios, and the extra microseconds per layer over "sdpa" (median of paired differences).

    python benchmarks/bench_decode.py [--quick] [--preset small-llama] [--lengths 256 1024] [--repeats 15]
                                      [--variants softmax affine sink gated]

The cache is filled with random keys/values of the requested length (decode cost does not depend on their
content), so no long prefill is timed or needed. Before each timed run the cache is cropped back to that length
and one untimed step resynchronises the affine running value sum (a crop invalidates it, by design), then `steps`
greedy tokens are timed. "hf-sdpa" (the unconverted model with transformers' SDPA attention) is the baseline.

--compile times what GPU users deploy instead: every model, the baseline included, under
torch.compile(fullgraph=True) with a transformers StaticCache (fixed shapes, so one graph per cache length); the
cache is reset and refilled with the same keys and values before each timed run.
"""
from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import affine_attention  # noqa: E402
from affine_attention.hf.presets import build_model  # noqa: E402
from affine_attention.variants import variant_names  # noqa: E402


class Decoder:
    """One model with its own synthetic cache of `length` positions; `run()` times `steps` greedy tokens.

    compiled: a StaticCache of length + steps + 1 positions and the model under torch.compile(fullgraph=True)."""

    def __init__(self, model, length: int, steps: int, seed: int = 0, compiled: bool = False):
        from transformers import DynamicCache, StaticCache

        self.length, self.steps, self.compiled = length, steps, compiled
        cfg, self.device = model.config, model.device
        gen = torch.Generator().manual_seed(seed)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (1, cfg.num_key_value_heads, length, head_dim)  # (B=1, Hkv, length, D) per layer
        self.kv = [tuple(torch.randn(shape, generator=gen).to(self.device, model.dtype) for _ in range(2))
                   for _ in range(cfg.num_hidden_layers)]
        if compiled:
            self.cache = StaticCache(config=cfg, max_cache_len=length + steps + 1)
            self.model = torch.compile(model, fullgraph=True)
        else:
            self.cache, self.model = DynamicCache(config=cfg), model
        self._fill()
        self.token = torch.tensor([[1]], device=self.device)

    def _fill(self):
        """The cache back to the `length` synthetic positions (a static cache cannot be cropped: reset, refill)."""
        if not self.compiled and self.cache.get_seq_length():
            extra = self.cache.get_seq_length() - self.length
            if extra:
                self.cache.crop(-extra)
        else:
            if self.compiled:
                self.cache.reset()
            for i, (k, v) in enumerate(self.kv):
                self.cache.update(k, v, i)
        self.pos = self.length

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _step(self):
        pos = torch.tensor([[self.pos]], device=self.device)
        logits = self.model(self.token, position_ids=pos, cache=self.cache, use_cache=True).logits
        self.token = logits[:, -1:].argmax(-1)
        self.pos += 1

    def run(self) -> float:
        self._fill()
        self._step()  # untimed: rebuilds what the crop invalidated
        self._sync()
        t0 = time.perf_counter()
        for _ in range(self.steps):
            self._step()
        self._sync()
        return (time.perf_counter() - t0) / self.steps


def bench(preset: str, lengths: list[int], repeats: int, steps: int, device: str = "cpu", dtype=None,
          seed: int = 0, variants: list[str] | None = None,
          compiled: bool = False) -> dict[int, dict[str, list[float]]]:
    torch.manual_seed(seed)
    base = build_model(preset, device=device, dtype=dtype).eval()
    models = {"hf-sdpa": base}
    for name in variants or variant_names():
        models[name] = affine_attention.convert(copy.deepcopy(base), name).eval()
    if compiled:
        # One code object (the model class's forward) compiles once per model and cache length: more than dynamo's
        # default recompile limit of 8.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(models) * len(lengths))
    rng = random.Random(seed)
    results = {}
    with torch.inference_mode():
        for length in lengths:
            decoders = {name: Decoder(m, length, steps, seed, compiled) for name, m in models.items()}
            for d in decoders.values():  # warm up every path once (and compile it)
                d.run()
            times = {name: [] for name in decoders}
            for _ in range(repeats):
                order = list(decoders)
                rng.shuffle(order)
                for name in order:
                    times[name].append(decoders[name].run())
            results[length] = times
            print(f"  cache {length}: hf-sdpa {statistics.median(times['hf-sdpa']) * 1e3:.2f} ms/token",
                  file=sys.stderr, flush=True)
    return results


def table(results: dict[int, dict[str, list[float]]], layers: int, baseline: str = "hf-sdpa") -> str:
    """Per cache length: the baseline's ms/token, then per variant its ratio to the baseline and its extra
    microseconds per layer (both medians over the paired repeats)."""
    names = [n for n in next(iter(results.values())) if n != baseline]
    lines = [f"| cache length | {baseline} ms/token | " + " | ".join(names) + " |",
             "|---:|---:|" + "---:|" * len(names)]
    for length, times in results.items():
        base = times[baseline]
        cells = []
        for n in names:
            ratio = statistics.median(t / b for t, b in zip(times[n], base))
            extra = statistics.median((t - b) / layers for t, b in zip(times[n], base)) * 1e6
            cells.append(f"{ratio:.2f}x ({extra:+.0f} µs)")
        lines.append(f"| {length} | {statistics.median(base) * 1e3:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short run: lengths 256 and 1024, 5 repeats, 4 steps")
    p.add_argument("--preset", default="small-llama", help="model preset (default: small-llama)")
    p.add_argument("--lengths", type=int, nargs="+", help="cache lengths (default 256 512 ... 8192)")
    p.add_argument("--repeats", type=int, help="timed repeats per variant and length (default 15)")
    p.add_argument("--steps", type=int, help="greedy tokens per timed run (default 8)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--variants", nargs="+", choices=variant_names(), help="variants to time (default: all)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--compile", action="store_true",
                   help="every model under torch.compile(fullgraph=True) with a StaticCache (default: eager, dynamic)")
    args = p.parse_args(argv)
    lengths = args.lengths or ([256, 1024] if args.quick else [256 * 2 ** i for i in range(6)])
    repeats = args.repeats or (5 if args.quick else 15)
    steps = args.steps or (4 if args.quick else 8)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = bench(args.preset, lengths, repeats, steps, args.device, getattr(torch, args.dtype),
                    variants=args.variants, compiled=args.compile)
    where = f"CPU threads {torch.get_num_threads()}" if args.device == "cpu" else args.device
    layers = build_model(args.preset).config.num_hidden_layers
    mode = "torch.compile(fullgraph=True) with a StaticCache" if args.compile else "eager with a DynamicCache"
    print(f"Cached greedy decoding, preset {args.preset} ({layers} layers), {args.dtype}, batch 1, {where}, {mode}: "
          f"per-token latency as a ratio to the unconverted transformers 'sdpa' model, and in parentheses the "
          f"extra time per layer (medians of {repeats} paired repeats, {steps} tokens each).\n")
    print(table(results, layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
