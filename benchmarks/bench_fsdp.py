"""Bytes FSDP2 all-gathers per micro-batch with fp32 parameters (today's: autocast only) and with the bf16
MixedPrecisionPolicy (train.precision = "bf16" under FSDP2), counted on CPU gloo by wrapping torch.distributed's
all-gather calls around one forward + backward of a converted Llama; and that the fp32 master weights stay fp32.
Beside them, what a KD teacher of the same size, sharded as the trainer shards it (`distributed.shard_frozen`),
all-gathers for one micro-batch: its forward, then its root once more for the loss to read the head.

    torchrun --nproc_per_node 2 benchmarks/bench_fsdp.py                 # hidden 256, 4 layers
    torchrun --nproc_per_node 2 benchmarks/bench_fsdp.py --json          # one JSON line (the tests read it)
"""
from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.distributed as dist

from affine_attention.train.config import ModelConfig
from affine_attention.train.distributed import DistInfo, setup, shard_frozen, teardown, wrap
from affine_attention.train.kd_chunked import final_hidden, output_head
from affine_attention.train.model import build_base, convert
from affine_attention.train.steps import accumulate_gradients, autocast_for

_GATHERS = ("all_gather_into_tensor", "all_gather_single")  # FSDP2 calls one of them (which one depends on torch)


@contextlib.contextmanager
def count_all_gathers(counter: list[int]):
    """Add the bytes each all-gather call delivers (its output tensor) to counter[0] while the context is open."""
    originals = {name: getattr(dist, name) for name in _GATHERS if hasattr(dist, name)}
    depth = [0]

    def counting(fn):
        def call(output, *args, **kwargs):
            if depth[0] == 0:  # one call may be built on the other: count the outermost only
                counter[0] += output.numel() * output.element_size()
            depth[0] += 1
            try:
                return fn(output, *args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    for name, fn in originals.items():
        setattr(dist, name, counting(fn))
    try:
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def measure(info: DistInfo, precision: str, mc: ModelConfig, micro_batch: int, seq: int) -> dict:
    model = convert(build_base(mc, 0), "affine", copy_model=False).train()
    autocast, bf16 = autocast_for(info.device, precision)
    model = wrap(model, info, "fsdp", bf16=bf16)
    rows = torch.randint(0, mc.vocab_size, (micro_batch, seq + 1), generator=torch.Generator().manual_seed(0))
    counter = [0]
    with count_all_gathers(counter):
        sums = accumulate_gradients(model, rows, torch.arange(micro_batch), n_micro=1, micro_batch=micro_batch,
                                    info=info, autocast=autocast, doc_sep=None)
    masters = {p.dtype for p in model.parameters()}  # the sharded parameters the optimizer steps
    grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    return {"bytes": counter[0], "loss": float(sums[0]), "master_dtypes": sorted(map(str, masters)),
            "grad_dtypes": sorted(map(str, grads))}


def measure_teacher(mc: ModelConfig, micro_batch: int, seq: int, dtype: torch.dtype) -> dict:
    """All-gather bytes of one micro-batch of a frozen teacher as kd.Teacher runs it (no grad, no KV cache)."""
    teacher = build_base(mc, 1).to(dtype).eval().requires_grad_(False)
    shard_frozen(teacher)
    rows = torch.randint(0, mc.vocab_size, (micro_batch, seq), generator=torch.Generator().manual_seed(0))
    counter = [0]
    with count_all_gathers(counter), torch.no_grad():
        final_hidden(teacher, {"input_ids": rows, "use_cache": False})
        teacher.unshard()  # the root resharded after its forward: the loss reads the head (kd.Teacher._forward)
        output_head(teacher)
        teacher.reshard()
    params = sum(p.numel() for p in teacher.parameters()) * torch.finfo(dtype).bits // 8
    return {"bytes": counter[0], "param_bytes": params}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    info = setup("cpu")
    if info.world < 2:
        raise SystemExit("run under torchrun with at least 2 processes: torchrun --nproc_per_node 2 " + __file__)
    mc = ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_layers=a.layers,
                     num_heads=4, num_kv_heads=2)
    res = {prec: measure(info, prec, mc, a.micro_batch, a.seq) for prec in ("fp32", "bf16")}
    res["ratio"] = res["bf16"]["bytes"] / res["fp32"]["bytes"]
    res["teacher"] = {str(dt).removeprefix("torch."): measure_teacher(mc, a.micro_batch, a.seq, dt)
                      for dt in (torch.float32, torch.bfloat16)}
    if info.is_main:
        if a.json:
            print(json.dumps(res))
        else:
            print(f"### FSDP2 all-gather bytes per micro-batch ({info.world} ranks, gloo, hidden {a.hidden}, "
                  f"{a.layers} layers, vocab {a.vocab}, {a.micro_batch} x {a.seq} tokens, forward + backward)\n")
            print("| parameters | all-gathered (MiB, per rank) | loss | master weights | gradients |")
            print("|---|---|---|---|---|")
            for prec, label in (("fp32", "fp32 (today, with or without autocast)"),
                                ("bf16", "bf16 MixedPrecisionPolicy")):
                r = res[prec]
                print(f"| {label} | {r['bytes'] / 2 ** 20:.2f} | {r['loss']:.4f} | {', '.join(r['master_dtypes'])} "
                      f"| {', '.join(r['grad_dtypes'])} |")
            print(f"\nbf16 / fp32 bytes: {res['ratio']:.4f}\n")
            print("| teacher (same size, shard_frozen, forward only) | all-gathered (MiB, per rank) | its parameters "
                  "(MiB) |")
            print("|---|---|---|")
            for dt, r in res["teacher"].items():
                print(f"| {dt} | {r['bytes'] / 2 ** 20:.2f} | {r['param_bytes'] / 2 ** 20:.2f} |")
    teardown()


if __name__ == "__main__":
    main()
