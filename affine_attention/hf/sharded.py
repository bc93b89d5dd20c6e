"""A model from the trainer's sharded step checkpoints (torch.distributed.checkpoint shards under `state/`), so every
loader (analyze, eval, the report, export) reads them as it reads a transformers folder, and such a checkpoint written
as a transformers folder without building the model (`write_pretrained`); the format is written by
train/checkpoint_dcp.py. Each shard records the variant spec in its safetensors metadata, as save_pretrained's files
do (spec_record.py), and every load compares it with config.json's."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from .._files import listed_view, notice_unlisted, read_json, require_keys, unlisted

STATE = "state"  # the folder of DCP's safetensors shards inside a step checkpoint
MANIFEST = "MANIFEST.json"  # a checkpoint's list of its files (train/checkpoint.py writes and verifies it)


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


def listed_files(path: str | Path) -> list[str]:
    """The relative paths a checkpoint's MANIFEST.json lists: the only files any reader of it reads."""
    where = Path(path) / MANIFEST
    fix = "its save did not finish or it was edited; use another checkpoint (resume picks the newest intact one)"
    if not where.is_file():
        raise ValueError(f"{path} has no {MANIFEST}, so what it holds is unknown; {fix}")
    return sorted(require_keys(read_json(where, fix), str(where), {"files": dict}, fix)["files"])


def shard_files(path: str | Path) -> list[Path]:
    """The safetensors shards of a step checkpoint's state/ folder (model and optimizer tensors) that its manifest
    lists."""
    return [Path(path) / r for r in listed_files(path) if r.startswith(f"{STATE}/") and r.endswith(".safetensors")]


@contextlib.contextmanager
def checkpoint_view(path: str | Path, announce: bool = True) -> Iterator[Path]:
    """The checkpoint `path` as a folder holding only the files its manifest lists (`_files.listed_view`), for
    readers that read a whole folder: DCP's reader would otherwise load any *.safetensors in state/ (a shard copied
    in from another step), transformers any tokenizer file. `announce`: name the unlisted files on stderr."""
    listed = listed_files(path)
    if announce:
        notice_unlisted(path, unlisted(path, listed, own=(MANIFEST,)), MANIFEST)
    with listed_view(path, listed) as view:
        yield view


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
    """DCP's safetensors reader of the shards in `path` (the state/ folder of a `checkpoint_view`: it reads every
    shard there), counting the bytes this rank reads (resume memory is ~ that)."""
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


# The largest weights file `write_pretrained` writes, in bytes (2 GB): what bounds its memory.
MAX_SHARD_BYTES = 2 * 10**9


def _unit(name: str) -> str:
    """The part of a weight name up to its first numeric component ("model.layers.3."): a weight conversion
    (transformers' fused MoE experts) reads only weights of one such unit, so no output file splits one."""
    parts = name.split(".")
    at = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return name if at is None else ".".join(parts[:at + 1]) + "."


def _plan(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Names grouped into files of at most `limit` bytes in state-dict order, whole units together (a unit larger
    than `limit` gets a file of its own, as save_pretrained gives an oversized tensor)."""
    units: dict[str, list[str]] = {}
    for name in sizes:
        units.setdefault(_unit(name), []).append(name)
    files: list[list[str]] = [[]]
    used = 0
    for names in units.values():
        size = sum(sizes[n] for n in names)
        if files[-1] and used + size > limit:
            files.append([])
            used = 0
        files[-1].extend(names)
        used += size
    return files


def write_pretrained(path: str | Path, out: str | Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write the model of sharded step checkpoint `path` into the folder `out` as save_pretrained writes it (config,
    generation config, hub loader, safetensors stamped with the variant spec, split into files of at most
    `max_shard_bytes` with transformers' index), in float32, without building the model: its names, shapes and tied
    weights come from a copy on the meta device, its tensors from the shards, one output file at a time (peak memory
    ~ max_shard_bytes + the largest tensor: the file's tensors and the shard pages of the one being read). Returns
    the weights files written. Single process; `out` exists (the caller commits it atomically)."""
    from .registration import register

    register()
    path, out = Path(path), Path(out)
    with checkpoint_view(path) as view:
        return _write_pretrained(view, path, out, max_shard_bytes)


def _write_pretrained(view: Path, path: Path, out: Path, max_shard_bytes: int) -> list[str]:
    """write_pretrained reading the listed files of checkpoint `path` through `view`."""
    import json

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from . import layers, models, spec_record

    config = AutoConfig.from_pretrained(view)
    check_spec(path, config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sd = {k: v for k, v in model.state_dict().items() if k not in (model._keys_to_ignore_on_save or ())}
    sd = remove_tied_weights_from_state_dict(sd, model)  # save_pretrained's choice of the name a tied weight keeps
    want = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, dict(sd)).items()}  # the names it writes
    files = _plan({k: v.numel() * v.element_size() for k, v in sd.items()}, max_shard_bytes)
    names = ([spec_record.SAFE_WEIGHTS_NAME] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    converted = isinstance(model, models.AffineModelMixin)  # what save_pretrained adds for a converted model
    metadata = {"format": "pt", **(spec_record.spec_metadata(layers.spec_from_config(config)) if converted else {})}
    reader = reader_for(view / STATE)
    written: dict[str, str] = {}
    shapes: dict[str, tuple] = {}
    total = 0
    for name, keys in zip(names, files):
        part = {k: torch.empty(sd[k].shape, dtype=sd[k].dtype) for k in keys}
        for k in keys:  # one tensor per read, in place: the shard pages it maps are let go before the next
            dcp.load({"model": {k: part[k]}}, storage_reader=reader, no_dist=True)
        part = {k: v.contiguous() for k, v in revert_weight_conversion(model, part).items()}
        save_file(part, str(out / name), metadata=metadata)
        written.update(dict.fromkeys(part, name))
        shapes.update({k: tuple(v.shape) for k, v in part.items()})
        total += sum(v.numel() * v.element_size() for v in part.values())
        del part
    if shapes != want:  # what the whole model's conversion gives: a conversion across two files would differ
        odd = sorted(k for k in set(shapes) | set(want) if shapes.get(k) != want.get(k))
        raise RuntimeError(f"export of {path}: the files hold weights {odd[:5]} unlike those save_pretrained writes "
                           "(a weight conversion spanning decoder layers?); export with a larger max_shard_bytes")
    # save_pretrained's facts in the config, then its small files (models.AffineModelMixin.save_pretrained)
    config.dtype, config.architectures = "float32", [type(model).__name__]
    if converted:
        config.auto_map = type(model).hub_auto_map()
        models.write_hub_loader(out)
    config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)
    if len(names) > 1:
        index = {"metadata": {"total_parameters": model.num_parameters(), "total_size": total}, "weight_map": written}
        (out / spec_record.SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names


def load_sharded_model(path: str | Path, dtype: torch.dtype | None = None):
    """The causal LM of sharded step checkpoint `path` on the CPU, in float32 (or `dtype`), built from its
    config.json and filled with the model's tensors only (the optimizer's stay on disk). Single process."""
    from transformers import AutoConfig

    from .registration import register

    register()  # the converted architectures, so that AutoConfig reads their configs
    path = Path(path)
    with checkpoint_view(path) as view:
        config = AutoConfig.from_pretrained(view)
        check_spec(path, config)
        model = _filled(config, view)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def _filled(config, view: Path):
    """The float32 causal LM of `config` with the model tensors of the checkpoint seen through `view`."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    # Built for real, not on meta + to_empty: non-persistent buffers (RoPE's inv_freq, constant sinks) are in no
    # checkpoint and must come from the constructors.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sd = model.state_dict()
    distinct(sd)
    dcp.load({"model": sd}, storage_reader=reader_for(view / STATE), no_dist=True)  # into the model's storage
    return model
