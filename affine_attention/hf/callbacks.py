"""transformers Trainer integration of the running statistics: one alpha_ma step per optimizer step, and the
warnings about a training set-up whose result would look wrong later (CPU autocast)."""
from __future__ import annotations

import warnings

from transformers import TrainerCallback

from ..variants.running_stats import step_running_stats
from .peft import check_adapter


class CpuAutocastWarning(UserWarning):
    """A Trainer on CPU with bf16=True (trl's SFTConfig default): see `check_cpu_autocast`."""


def check_cpu_autocast(args) -> None:
    """Warn when `args` (TrainingArguments, trl's configs) train on CPU in bf16 or fp16: accelerate then runs every
    forward under torch.autocast, and leaves the trained model's `forward` wrapped in it after `train()`. That model
    then differs from its own saved checkpoint reloaded in float32 (by 1.03 in the logits on SmolLM2-135M as issue
    44 reports, weights equal), which looks like a save bug and is not one. trl's SFTConfig sets bf16=True by
    default, so the user may never have asked for it."""
    half = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
    if half is None or args.device.type != "cpu":
        return
    warnings.warn(f"training on CPU with {half}=True (trl's SFTConfig sets bf16=True by default): every forward runs "
                  "under torch.autocast, and after train() the model's forward stays wrapped in it, so this model's "
                  "logits differ from those of the checkpoint it saves, reloaded in float32 (weights equal). To "
                  f"train and compare in float32 on CPU pass {half}=False, e.g. "
                  f"SFTConfig(..., {half}=False)", CpuAutocastWarning, stacklevel=2)


class RunningStatsCallback(TrainerCallback):
    """Steps the running statistics (alpha_ma) after every optimizer step, over the data-parallel group.

        trainer = Trainer(model, args, ..., callbacks=[RunningStatsCallback()])

    group: the data-parallel process group to reduce over (None: the default group, right for plain DDP/FSDP).
    Gradient accumulation needs nothing more: the statistics of every micro-batch add up until the step.
    """

    def __init__(self, group=None):
        self.group = group

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        check_cpu_autocast(args)
        if model is not None:
            check_adapter(model)  # a PEFT model built without peft_config: warn before training, not after saving

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("RunningStatsCallback needs the model: the Trainer passes it to callbacks; when "
                             "calling the hook by hand pass model=...")
        step_running_stats(model, group=self.group)
