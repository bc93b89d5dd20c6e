"""transformers Trainer integration of the running statistics: one alpha_ma step per optimizer step."""
from __future__ import annotations

from transformers import TrainerCallback

from ..variants.running_stats import step_running_stats
from .peft import check_adapter


class RunningStatsCallback(TrainerCallback):
    """Steps the running statistics (alpha_ma) after every optimizer step, over the data-parallel group.

        trainer = Trainer(model, args, ..., callbacks=[RunningStatsCallback()])

    group: the data-parallel process group to reduce over (None: the default group, right for plain DDP/FSDP).
    Gradient accumulation needs nothing more: the statistics of every micro-batch add up until the step.
    """

    def __init__(self, group=None):
        self.group = group

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            check_adapter(model)  # a PEFT model built without peft_config: warn before training, not after saving

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("RunningStatsCallback needs the model: the Trainer passes it to callbacks; when "
                             "calling the hook by hand pass model=...")
        step_running_stats(model, group=self.group)
