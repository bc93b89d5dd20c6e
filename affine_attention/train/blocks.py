"""Activation checkpointing (every k-th decoder block) and per-block torch.compile of a causal LM, applied before
DDP / FSDP2 wrapping (the order of torchtitan: checkpoint, compile, shard).

Each decoder layer is compiled in place (`nn.Module.compile`: parameter names and checkpoints unchanged), and
transformers' own checkpointing of a layer is traced by dynamo as a checkpoint region inside that layer's graph.
Nothing inside such a region may change Python state (dynamo breaks the graph there): the variants' running
statistics and the trainer's token statistics (metrics.TokenStats) are in-place updates of buffers, which the
compiled graph applies once per forward and never again when the backward recomputes the block.
"""
from __future__ import annotations

import torch
from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """model.model.layers of a transformers causal LM (every supported family), or a clear error."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers (decoder layers): activation checkpointing, "
                         "per-block compile and FSDP2 wrapping need them")
    return layers


def checkpoint_blocks(model: nn.Module, every: int) -> list[int]:
    """Checkpoint decoder layers 0, every, 2 * every, ... (non-reentrant); returns their indices."""
    if every < 1:
        raise ValueError(f"activation checkpointing every {every} blocks: use 1 (every block) or more")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    chosen = []
    for i, layer in enumerate(decoder_layers(model)):
        layer.gradient_checkpointing = i % every == 0
        if layer.gradient_checkpointing:
            chosen.append(i)
    return chosen


def compile_blocks(model: nn.Module, **compile_kwargs) -> int:
    """torch.compile every decoder layer in place, fullgraph by default (a graph break inside a block is an error,
    not a silent slow path); returns how many."""
    layers = decoder_layers(model)
    if any(getattr(layer, "gradient_checkpointing", False) for layer in layers) and _kernelized(model):
        # transformers >= 5.25 with the `kernels` package wraps attention forwards (use_kernelized_func) in a
        # ContextVar set / reset: a Python side effect inside every checkpoint region, which dynamo refuses under
        # fullgraph. The pair leaves no state behind, so skipping its replay in the recompute is exact.
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in layers:
        layer.compile(**{"fullgraph": True, **compile_kwargs})
    return len(layers)


def prepare_blocks(model: nn.Module, *, checkpointing: bool, every: int, compile: bool) -> None:
    """Checkpointing first, then compile (so the checkpoint is traced inside each block's graph)."""
    if checkpointing:
        checkpoint_blocks(model, every)
    if compile:
        compile_blocks(model)


def _kernelized(model: nn.Module) -> bool:
    """Whether any module runs through the `kernels` package's forward wrapper (it records `_kernel_funcs`)."""
    return any(hasattr(m, "_kernel_funcs") for m in model.modules())
