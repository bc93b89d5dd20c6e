"""A model from the trainer's sharded step checkpoints (torch.distributed.checkpoint shards under `state/`), so every
loader (analyze, eval, the report, export) reads them as it reads a transformers folder; the format is written by
train/checkpoint_dcp.py. Each shard records the variant spec in its safetensors metadata, as save_pretrained's files
do (spec_record.py), and every load compares it with config.json's."""
from __future__ import annotations

import math
from pathlib import Path

import torch

STATE = "state"  # the folder of DCP's safetensors shards inside a step checkpoint


def is_sharded(path: str | Path) -> bool:
    """Whether `path` is a sharded step checkpoint (its weights only in state/, no transformers weights file)."""
    path = Path(path)
    return (path / STATE).is_dir() and not any(path.glob("model*.safetensors"))


def distinct(sd: dict[str, torch.Tensor]) -> dict[str, str]:
    """Drop from `sd`, in place, every entry whose tensor another entry already holds (a tied lm_head); returns
    {name dropped: name kept}. DCP's safetensors files take distinct tensors only."""
    seen, aliases = {}, {}
    for name, t in list(sd.items()):
        local = t.to_local() if hasattr(t, "to_local") else t
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.dtype)
        if local.numel() and key in seen:
            aliases[name] = seen[key]
            del sd[name]
        else:
            seen[key] = name
    return aliases


def shard_files(path: str | Path) -> list[Path]:
    """The safetensors shards of a step checkpoint's state/ folder (model and optimizer tensors)."""
    return sorted((Path(path) / STATE).glob("*.safetensors"))


def stamp_spec(files: list[Path], config) -> None:
    """Record the variant spec of `config` in the metadata of each shard (after DCP wrote them; each rank its share)."""
    from . import layers, spec_record

    record = spec_record.spec_metadata(layers.spec_from_config(config))
    for f in files:
        spec_record.stamp(str(f), record)


def check_spec(path: str | Path, config) -> None:
    """Refuse step checkpoint `path` when the variant spec its shards record differs from `config`'s (its
    config.json, or the model a resume loads into), naming both; shards that record none (older runs) warn."""
    from . import spec_record

    spec_record.check_weights_spec(config, shard_files(path), f"the step checkpoint {path}")


def reader_for(path: Path):
    """DCP's safetensors reader of the shards in `path`, counting the bytes this rank reads (resume memory is ~
    that)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    class Counting(HuggingFaceStorageReader):
        bytes_read, bytes_total = 0, 0

        def read_metadata(self):
            md = super().read_metadata()
            self.bytes_total = sum(math.prod(m.size) * m.properties.dtype.itemsize
                                   for m in md.state_dict_metadata.values())
            return md

        def read_data(self, plan, planner):
            self.bytes_read += sum(math.prod(item.lengths) * self.storage_data[item.storage_index].dtype.itemsize
                                   for item in plan.items)
            return super().read_data(plan, planner)

    return Counting(str(path))


def load_sharded_model(path: str | Path, dtype: torch.dtype | None = None):
    """The causal LM of sharded step checkpoint `path` on the CPU, in float32 (or `dtype`), built from its
    config.json and filled with the model's tensors only (the optimizer's stay on disk). Single process."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    from .registration import register

    register()  # the converted architectures, so that AutoConfig reads their configs
    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    check_spec(path, config)
    # Built for real, not on meta + to_empty: non-persistent buffers (RoPE's inv_freq, constant sinks) are in no
    # checkpoint and must come from the constructors.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sd = model.state_dict()
    distinct(sd)
    dcp.load({"model": sd}, storage_reader=reader_for(path / STATE), no_dist=True)  # into the model's storage
    if dtype is not None:
        model.to(dtype)
    return model.eval()
