"""Packed-row training throughput: tokens/s of a training step at seq 2048 with 16 documents per row, with document
masking (restarting position_ids: the variants get document_ids) and without (attention across documents), for
softmax and affine, in the same run (interleaved, medians of paired ratios; benchmarks/common.py).

    python benchmarks/bench_packing.py                 # tiny preset's model at seq 2048
    python benchmarks/bench_packing.py --repeats 3 --threads 1
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import paired_ratios  # noqa: E402

from affine_attention.train.config_load import load_config  # noqa: E402
from affine_attention.train.kd import ce_loss  # noqa: E402
from affine_attention.train.model import build_base, convert  # noqa: E402
from affine_attention.train.optim import build_optimizer  # noqa: E402
from affine_attention.train.packing import model_inputs  # noqa: E402
from affine_attention.variants.running_stats import step_running_stats  # noqa: E402

SEP = 0  # the separator token of the synthetic rows


def _rows(batch: int, T: int, docs: int) -> torch.Tensor:
    """(batch, T + 1) token rows, each holding `docs` documents of equal length ending with SEP."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(1, 4096, (batch, T + 1), generator=g)
    rows[:, T // docs - 1::T // docs] = SEP
    return rows


def _step(model, rows: torch.Tensor, sep: int | None):
    opt = build_optimizer(model, load_config("tiny").optim)
    inputs, targets = rows[:, :-1], rows[:, 1:]

    def step():
        ce_loss(model(**model_inputs(inputs, sep)).logits, targets).backward()
        opt.step()
        step_running_stats(model)
        opt.zero_grad(set_to_none=True)
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config("tiny")
    mc = dataclasses.replace(cfg.model, max_position_embeddings=args.seq_len)
    base = build_base(mc, 0)
    rows = _rows(args.batch, args.seq_len, args.docs)
    methods = {}
    for v in ("softmax", "affine"):
        for masked in (False, True):
            model = convert(base, v).train()
            methods[f"{v}, {'per document' if masked else 'across documents'}"] = _step(model, rows,
                                                                                         SEP if masked else None)
    base_name = "softmax, across documents"
    res = paired_ratios(methods, base_name, torch.device("cpu"), repeats=args.repeats, warmup=1)
    tokens = args.batch * args.seq_len
    print(f"### Training step at seq {args.seq_len}, {args.docs} documents per row, batch {args.batch} (tiny preset's "
          f"model, float32, {torch.get_num_threads()} thread(s), {args.repeats} paired repeats)\n")
    print("| variant, attention | tokens/s | step time vs softmax across documents |\n|---|---:|---:|")
    for name, r in res.items():
        print(f"| {name} | {tokens / r['median_s']:,.0f} | {r['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
