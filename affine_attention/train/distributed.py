"""torchrun set-up (gloo on CPU, nccl on GPU), DDP / FSDP2 wrapping, and full (unsharded) state dicts.

Every rank runs the same code on its rows of each global batch (data.TrainBatches). DDP and FSDP2 average
gradients over ranks, and each rank's loss is the mean over its equally sized rows, so the update equals the
single-process one on the whole global batch. The trainer never draws rank-dependent random numbers, so all
ranks share one RNG stream. Checkpoints are written by rank 0 to a filesystem every rank can read.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(setting: str, local_rank: int) -> torch.device:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("train.device = 'cuda' but CUDA is not available; use train.device = 'cpu'")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(device_setting: str) -> DistInfo:
    """Initialise torch.distributed when started by torchrun (WORLD_SIZE > 1); otherwise a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_setting, local_rank)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank, world, local_rank, device)


def teardown() -> None:
    """After a run that ended normally on this rank: wait for every rank, then destroy the process group.

    The barrier keeps a rank from closing its connections while a peer still finishes the last collective (gloo
    can then wait for the peer's data until its 30-minute timeout). Not for a run that raised: a peer may be inside
    a collective this rank will never join, and destroying the group then deadlocks; exiting lets torchrun stop it.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def wrap(model: nn.Module, info: DistInfo, parallel: str, bf16: bool = False) -> nn.Module:
    """DDP or FSDP2 (fully_shard on each decoder layer, then the root) under torchrun; the model itself otherwise.

    bf16 under FSDP2: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): parameters are all-gathered and
    computed with in bf16 (half the all-gather bytes of fp32), gradients reduced in fp32 into the fp32 shards the
    optimizer keeps (the master weights). Under DDP bf16 is autocast's alone (steps.autocast_for)."""
    if not info.enabled:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # Buffers are not broadcast: variants with running statistics keep them equal on every rank themselves
        # (one all-reduce per step, variants.running_stats), and the end-of-run check verifies it.
        ids = [info.device.index] if info.device.type == "cuda" else None
        return DDP(model, device_ids=ids, broadcast_buffers=False)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .blocks import decoder_layers

    layers = decoder_layers(model)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
          else MixedPrecisionPolicy())
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def shard_frozen(model: nn.Module) -> nn.Module:
    """FSDP2 for a frozen model that only runs forwards (a KD teacher): each decoder layer and the root sharded across
    ranks in the dtype the model was loaded in, with no gradients and no optimizer state. A layer's parameters are
    gathered for its forward and freed after it, so a rank holds 1/world of the model plus one layer at a time; the
    caller gathers the root (embeddings, final norm, head) with `unshard` when the loss reads the head, and frees it
    with `reshard`.
    Collective: every rank must call the model's forward the same number of times."""
    from torch.distributed.fsdp import fully_shard

    from .blocks import decoder_layers

    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    return model


@contextlib.contextmanager
def accumulation(model: nn.Module, info: DistInfo, sync: bool):
    """Skip the gradient all-reduce on micro-batches before the last of a step (same result, less traffic)."""
    if not info.enabled or sync:
        yield
        return
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
        return
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    yield


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict) unsharded, on CPU, keyed by parameter names. Collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return (get_model_state_dict(model, options=_options()),
            get_optimizer_state_dict(model, optimizer, options=_options()))


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict,
                    optim_sd: dict | None) -> list[str]:
    """Load full state dicts into a (possibly wrapped) model and optimizer; returns the model's missing keys."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    result = set_model_state_dict(model, model_sd, options=_options(strict=False))
    if optimizer is not None and optim_sd is not None:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=_options())
    return list(result.missing_keys)


def all_equal(t: torch.Tensor, info: DistInfo) -> float:
    """Max |t_rank - t_rank0| over ranks (0.0 in a single process). Collective."""
    if not info.enabled:
        return 0.0
    gathered = [torch.empty_like(t) for _ in range(info.world)]
    dist.all_gather(gathered, t.contiguous())
    return max(float((g - gathered[0]).abs().max()) for g in gathered) if t.numel() else 0.0


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t)
    return t
