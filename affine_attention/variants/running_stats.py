"""Running statistics of attention variants (affine's alpha_ma), stepped from outside the model: modules only
accumulate in forward; `step_running_stats` reduces every layer's accumulator in one collective and applies the
update, once per optimizer step. A model trained without it gets one loud warning (see `watch`).
"""
from __future__ import annotations

import warnings
import weakref

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook


class RunningStatsWarning(UserWarning):
    """Training updates a model whose running statistics nobody steps (alpha_ma would stay frozen)."""


def recomputing() -> bool:
    """True while autograd runs a forward again inside backward (activation checkpointing, reentrant or not).

    Stateless: outside backward the graph task id is -1. Under torch.compile the check is skipped: AOTAutograd
    applies a graph's buffer mutations once, whatever the backward recomputes."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class RunningStats(nn.Module):
    """The protocol of a module with running statistics: forwards in training add to its `running_accumulator()`
    (a buffer), and `apply_running_stats(acc)` applies one step from that accumulator summed over the data-parallel
    group. `step_running_stats` finds such modules by this class (not by attribute names, which wrappers such as
    PEFT's ModulesToSaveWrapper forward too). A copy (`copy.deepcopy`, pickling, PEFT's trained copy of a module) is
    watched like the original (see `watch`)."""

    def running_accumulator(self) -> Tensor:
        raise NotImplementedError

    def apply_running_stats(self, acc: Tensor) -> None:
        raise NotImplementedError

    def __setstate__(self, state):
        super().__setstate__(state)
        watch(self)


def stat_modules(model: nn.Module) -> list[RunningStats]:
    """Every submodule with running statistics, once per accumulator (a module reached twice is stepped once)."""
    seen: set[int] = set()
    mods = []
    for m in model.modules():
        if isinstance(m, RunningStats) and id(m.running_accumulator()) not in seen:
            seen.add(id(m.running_accumulator()))
            mods.append(m)
    return mods


def accumulator_names(model: nn.Module) -> list[str]:
    """The buffer names (as `model.named_buffers()` gives them) of every running-statistics accumulator in `model`:
    what a data-parallel wrapper must leave rank-local (DDP's `_ddp_params_and_buffers_to_ignore`)."""
    accumulators = {id(m.running_accumulator()) for m in stat_modules(model)}
    return [name for name, buf in model.named_buffers() if id(buf) in accumulators]


@torch.no_grad()
def step_running_stats(model: nn.Module, group=None) -> int:
    """Apply one running-statistics step (alpha_ma EMA) to every layer of `model`; returns how many layers.

    Call it once per optimizer step, on every data-parallel rank (it is a collective when torch.distributed is
    initialised): the accumulators of all layers are summed over `group` (None: the default group) in ONE
    all-reduce, so alpha_ma follows the token-weighted mean of alpha over every micro-batch of the step on every
    rank, identically everywhere. Layers that saw no real token keep their alpha_ma. Pass the unwrapped model or
    the DDP/FSDP2-wrapped one: both reach the same layers.
    """
    mods = stat_modules(model)
    for m in mods:
        _WATCHED.discard(m)
    if not mods:
        return 0
    accs = [m.running_accumulator() for m in mods]
    flat = torch.cat([a.to(accs[0].device) for a in accs])  # (sum of (Hq + 1),) int64
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    elif group is not None:
        raise ValueError("step_running_stats: group was given but torch.distributed is not initialised; "
                         "pass group=None in a single process")
    for m, part in zip(mods, flat.split([a.numel() for a in accs])):
        m.apply_running_stats(part)
    return len(mods)


# --- the loud warning when nobody steps -----------------------------------------------------------------------
# A global optimizer post-step hook (outside any model forward, so nothing here is traced by torch.compile) reads
# each watched training-mode module's pending token count. A count that grew since the previous optimizer step means
# forwards of a new step accumulated on top of a step that was never applied: warn once. Several optimizers stepping
# in one iteration do not trigger it (no forward in between). `step_running_stats` stops the watch, so a correctly
# stepped run reads the counts once, at its first optimizer step; a module that stays idle is dropped after a few.
_WATCHED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_HOOK = None
_WARNED = False
_IDLE_CHECKS = 8  # optimizer steps with nothing accumulated before an idle module is no longer watched
_MESSAGE = ("affine_attention: this model is training but its running statistics are never stepped, so alpha_ma "
            "stays frozen at its current value (0 for a new model). Call `affine_attention.step_running_stats(model)` "
            "once per optimizer step (on every rank), or give the transformers Trainer `callbacks=[RunningStatsCallback()]` "
            "(from affine_attention.hf.callbacks import RunningStatsCallback). This warning is shown once.")


def watch(module: nn.Module) -> None:
    """Called by a module with running statistics when it is built or copied: warn once if training never steps it.
    Its accumulator's last entry must count the tokens accumulated since the last step."""
    global _HOOK
    module._pending_at_last_optimizer_step = None
    module._idle_optimizer_steps = 0
    _WATCHED.add(module)
    if _HOOK is None:
        _HOOK = register_optimizer_step_post_hook(_after_optimizer_step)


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    global _WARNED
    # A model on the meta device (a dry run's, a deferred init) holds no counts to read, and any other model's
    # optimizer step would fail reading them.
    due = [m for m in list(_WATCHED) if m.training and not m.running_accumulator().is_meta]
    if not due:
        return
    grew = False
    dev = due[0].running_accumulator().device
    # The accumulator's last entry counts the tokens accumulated; one host sync, not one per layer.
    counts = torch.stack([m.running_accumulator()[-1].to(dev) for m in due]).tolist()
    for m, count in zip(due, counts):
        last = m._pending_at_last_optimizer_step
        # Only a step that left something pending counts: after one with nothing accumulated (the first step, or the
        # zero-gradient step torch.distributed.checkpoint takes to build optimizer state on resume) growth is new work.
        grew |= last is not None and last > 0 and count > last
        m._pending_at_last_optimizer_step = count
        m._idle_optimizer_steps = m._idle_optimizer_steps + 1 if count == 0 else 0
        if m._idle_optimizer_steps >= _IDLE_CHECKS:
            _WATCHED.discard(m)
    if grew and not _WARNED:
        _WARNED = True
        _WATCHED.clear()
        warnings.warn(_MESSAGE, RunningStatsWarning, stacklevel=3)
