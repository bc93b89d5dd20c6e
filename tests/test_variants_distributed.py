"""alpha_ma stays identical on every data-parallel rank (2 gloo processes started by torch.multiprocessing)."""
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from affine_attention.variants import AttentionShape, build_variant
from affine_attention.variants.running_stats import step_running_stats


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # same weights on every rank
        m = build_variant("affine", AttentionShape(16, 2, 2, 8)).train()
        with torch.no_grad():
            m.alpha_proj.weight.normal_()
        torch.manual_seed(100 + rank)  # different data on every rank, different token counts
        T = 5 + 3 * rank
        for _ in range(3):
            q, k, v = (torch.randn(2, 2, T, 8) for _ in range(3))
            x = torch.randn(2, T, 16)
            m(q, k, v, x, is_causal=True)
            step_running_stats(m)  # one collective: the token-weighted mean over both ranks
        torch.save({"alpha_ma": m.alpha_ma.clone()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_alpha_ma_equal_across_two_gloo_ranks(tmp_path):
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    a = torch.load(tmp_path / "rank0.pt", weights_only=True)["alpha_ma"]
    b = torch.load(tmp_path / "rank1.pt", weights_only=True)["alpha_ma"]
    assert torch.equal(a, b)
    assert torch.all(a != 0)
