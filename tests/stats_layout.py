"""The same tokens trained in any parallel layout (ranks x micro-batches), for the running-statistics tests (no tests
here). Run under torchrun it trains one rank of a DDP layout and saves that rank's alpha_ma:

    torchrun --nproc_per_node 2 tests/stats_layout.py OUT_DIR MICRO_BATCHES
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from test_hf_common import VOCAB, tiny

import affine_attention

STEPS, ROWS, T = 3, 8, 12


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch: input_ids (ROWS, T) and a left-padding attention_mask (ROWS, T) whose real
    lengths differ per row, so a plain mean of micro-batch means would differ from the token-weighted mean."""
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (ROWS, T), generator=gen)
    pads = torch.randint(0, T // 2, (ROWS,), generator=gen)
    return ids, (torch.arange(T)[None] >= pads[:, None]).long()


def model():
    """A tiny converted Llama whose alpha depends on the input (W_alpha away from its zero init)."""
    m = tiny("llama", "affine", seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in m.model.layers:
            w = layer.self_attn.attn_variant.alpha_proj.weight
            w.copy_(torch.randn(w.shape, generator=gen) * 2.0)
    return m.train()


def alpha_ma(m) -> torch.Tensor:
    """(layers, Hq) float64."""
    return torch.stack([layer.self_attn.attn_variant.alpha_ma.double() for layer in m.model.layers])


def train(*, rank: int = 0, world: int = 1, micro: int = 1, checkpointing: bool = False, reentrant: bool = False,
          ddp: bool = False, step=affine_attention.step_running_stats):
    """SGD for STEPS steps on this rank's rows of every global batch, in `micro` micro-batches; the loss is the
    token sum normalised by the global token count, so the update is the same in every layout. Returns the model.
    `ddp` wraps it in DDP with the default broadcast_buffers=True (transformers' Trainer default)."""
    m = model()
    if checkpointing:
        m.config.use_cache = False
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    net = torch.nn.parallel.DistributedDataParallel(m) if ddp else m
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    for s in range(STEPS):
        ids, mask = batch(s)
        weights = (mask[:, 1:] * mask[:, :-1]).float()  # (ROWS, T - 1): real (input, target) pairs
        total = weights.sum()
        mine = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
        chunks = zip(ids[mine].chunk(micro), mask[mine].chunk(micro), weights[mine].chunk(micro))
        for ci, cm, cw in chunks:
            # No `no_sync`: DDP then broadcasts rank 0's buffers before every micro-batch, the hazard to survive.
            pos = (cm.cumsum(-1) - 1).clamp(min=0)
            logits = net(input_ids=ci, attention_mask=cm, position_ids=pos).logits
            nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), ci[:, 1:].flatten(), reduction="none")
            ((nll * cw.flatten()).sum() / total * world).backward()  # DDP averages gradients over ranks
        opt.step()
        if step is not None:
            step(m)
        opt.zero_grad(set_to_none=True)
    return m


def _main(out_dir: str, micro: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        m = train(rank=rank, world=world, micro=micro, checkpointing=rank == 1, ddp=True)
        torch.save({"alpha_ma": alpha_ma(m)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.barrier()  # as train.distributed.teardown: no rank leaves while a peer finishes the last collective
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    _main(sys.argv[1], int(sys.argv[2]))
