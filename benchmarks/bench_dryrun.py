"""The dry run's memory formula (affine_attention/train/dryrun.py) against the measured peak of the same configuration:
each configuration trains 2 optimizer steps in a fresh CPU process (fp32, one thread) through the trainer's own step
functions; measured = peak RSS (ru_maxrss) minus the RSS just before the model is built. The child runs with a fixed
glibc mmap threshold (MALLOC_MMAP_THRESHOLD_): by default glibc raises the threshold after the first large free, and
later tensors then come from the heap, whose freed pages stay resident, so peak RSS would count memory that was
already free (measured: 1727 MiB instead of 1159 MiB for the first configuration).

    python benchmarks/bench_dryrun.py            # prints estimate, measured and their ratio per configuration
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

CONFIGS = {
    "no checkpointing": ["model.hidden_size=512", "model.num_layers=4", "model.num_heads=8", "model.num_kv_heads=2",
                         "model.intermediate_size=1536", "data.seq_len=512", "train.micro_batch=8",
                         "train.global_batch=16"],
    "activation checkpointing": ["model.hidden_size=512", "model.num_layers=8", "model.num_heads=8",
                                 "model.num_kv_heads=2", "model.intermediate_size=1536", "data.seq_len=512",
                                 "train.micro_batch=16", "train.global_batch=32", "train.activation_checkpointing=true"],
    "large vocabulary, chunked loss": ["model.hidden_size=384", "model.num_layers=2", "model.num_heads=6",
                                       "model.num_kv_heads=2", "model.intermediate_size=1024", "model.vocab_size=65536",
                                       "data.seq_len=512", "train.micro_batch=8", "train.global_batch=8",
                                       "train.loss_chunk_tokens=512"],
}
COMMON = ["model.max_position_embeddings=512", "train.device='cpu'", "train.precision='fp32'", "variant.name='affine'"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def child(overrides: list[str]) -> None:
    import torch

    from affine_attention.train.config_load import load_config
    from affine_attention.train.distributed import DistInfo
    from affine_attention.train.model import build_base, convert
    from affine_attention.train.optim import build_optimizer
    from affine_attention.train.steps import accumulate_gradients, autocast_for, clip_and_step
    from affine_attention.variants.running_stats import step_running_stats

    torch.set_num_threads(1)
    cfg = load_config("tiny", COMMON + overrides)
    tc, mc = cfg.train, cfg.model
    torch.randn(64, 64) @ torch.randn(64, 64)  # the first op's one-off allocations are not the model's
    before = _rss()
    model = convert(build_base(mc, 0, eos_token_id=0, pad_token_id=1), "affine", copy_model=False).train()
    if tc.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = build_optimizer(model, cfg.optim)
    autocast, _ = autocast_for(torch.device("cpu"), "fp32")
    n_micro = tc.global_batch // tc.micro_batch
    for _ in range(2):
        rows = torch.randint(0, mc.vocab_size, (tc.global_batch, cfg.data.seq_len + 1))
        accumulate_gradients(model, rows, torch.arange(tc.global_batch), n_micro=n_micro, micro_batch=tc.micro_batch,
                             info=DistInfo(), autocast=autocast, doc_sep=None, chunk=tc.loss_chunk_tokens)
        clip_and_step(model, optimizer, cfg.optim.clip_grad_norm)
        step_running_stats(model)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"measured": peak - before}))


def main() -> None:
    from affine_attention.train.config_load import load_config
    from affine_attention.train.dryrun import memory_terms
    from affine_attention.train.model import build_base, convert, count_params

    print(f"{'configuration':<32} {'estimate MiB':>13} {'measured MiB':>13} {'estimate/measured':>18}")
    for name, overrides in CONFIGS.items():
        cfg = load_config("tiny", COMMON + overrides)
        params = count_params(convert(build_base(cfg.model, 0, meta=True), "affine"))
        est = memory_terms(cfg, params, world=1, bf16=False)
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(overrides)], capture_output=True,
                             text=True, check=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
        measured = json.loads(out.stdout.strip().splitlines()[-1])["measured"]
        print(f"{name:<32} {est['peak'] / 2**20:>13.0f} {measured / 2**20:>13.0f} {est['peak'] / measured:>18.3f}")
        terms = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in est.items() if k != "peak" and v)
        print(f"  terms (MiB): {terms}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        main()
