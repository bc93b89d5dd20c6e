"""Sharded step checkpoints (format 2) through torch.distributed.checkpoint: every rank writes and reads back only
its own part of the model and optimizer state (under FSDP2 ~1/world of it), optionally in the background.

run_dir/checkpoints/step-00000100/ holds:
  state/shard-*.safetensors     DCP's HuggingFaceStorageWriter output: one file per writing rank, each tensor's
                                offsets in the file's safetensors header (no pickled .metadata file)
  optimizer.json                AdamW param_groups (the tensors are in state/)
  config.json, tokenizer files  what `affine-attention export` needs to write a transformers folder
  rng.safetensors, trainer_state.json, MANIFEST.json   as in the full format (checkpoint.py)
Written into a hidden temporary folder named by rank 0; each rank records the variant spec in the safetensors
metadata of a share of the shards (hf/sharded.py; checked on every load) and hashes them, rank 0 writes the manifest
last and renames the folder (checkpoint.commit), so the name appears only once every rank is done.
With train.async_checkpoint the shards are written by a background thread on a process group of its own (as
torchtitan does); the commit happens at the next save or at the end of the run, so until then the previous
checkpoint is the newest one a resume sees.
"""
from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..hf.sharded import STATE, check_spec, checkpoint_view, distinct, reader_for, stamp_spec
from ..hf.spec_record import check_weights_spec, weights_files
from . import checkpoint as ckpt
from .distributed import DistInfo, barrier, load_full_state

FORMAT = 2


def _gather(obj: Any, info: DistInfo) -> list[Any]:
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world
    dist.all_gather_object(out, obj)
    return out


def _together(fn, info: DistInfo, run: bool = True) -> Any:
    """fn() where `run`, then every rank raises if any rank failed: a rank that fails alone (a full disk on rank 0)
    must not leave its peers waiting in the next collective."""
    result, error = None, None
    if run:
        try:
            result = fn()
        except Exception as err:  # re-raised below, on every rank
            error = err
    problems = [p for p in _gather(None if error is None else f"{type(error).__name__}: {error}", info) if p]
    if error is not None:
        raise error
    if problems:
        raise RuntimeError(f"checkpoint: another rank failed: {problems[0]}")
    return result


def sharded_state(model, optimizer) -> tuple[dict[str, Any], list[dict], dict[str, str]]:
    """({"model": ..., "optim": ...} with DTensor shards under FSDP2 and plain tensors otherwise, param_groups,
    {name left out: the name it shares its tensor with}). The groups hold no tensors and go to JSON, and a tied
    weight (lm_head = embeddings) is kept once: DCP's safetensors files take distinct tensors only."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    groups = osd.pop("param_groups")
    return {"model": msd, "optim": osd}, groups, distinct(msd)


class ShardedSaver:
    """Writes format-2 checkpoints; `wait` commits a background save (collective, every rank)."""

    def __init__(self, info: DistInfo, background: bool = False):
        self.info, self.background, self.pending = info, background, None
        # A background save runs collectives while training runs its own: on the default group they could cross.
        self.group = dist.new_group(backend="gloo") if background and info.enabled else None

    def save(self, target: Path, *, model, optimizer, hf_model, tokenizer, trainer_state: dict, after=None) -> None:
        """Write step checkpoint `target` (collective). `after` runs on rank 0 once it is committed (pruning)."""
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        self.wait()
        info, target = self.info, Path(target)
        tmp = ckpt.temporary(target, _gather(uuid.uuid4().hex[:8], info)[0])  # one name, chosen by rank 0
        state, groups, _ = sharded_state(model, optimizer)

        def small_files():
            tmp.mkdir(parents=True)
            hf_model.config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "optimizer.json").write_text(json.dumps({"param_groups": groups}, indent=1))
            ckpt.write_rng(tmp)
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))

        try:
            _together(small_files, info, run=info.is_main)
            writer = HuggingFaceStorageWriter(str(tmp / STATE), save_distributed=True)
            if self.background:
                future = torch.distributed.checkpoint.async_save(state, storage_writer=writer,
                                                                 process_group=self.group, no_dist=not info.enabled)
            else:
                torch.distributed.checkpoint.save(state, storage_writer=writer, no_dist=not info.enabled)
                future = None
        except BaseException:
            self._discard(tmp)
            raise
        self.pending = (future, tmp, target, {"format": FORMAT, "step": trainer_state["step"],
                                              "world_size": info.world}, after, hf_model.config)
        if not self.background:
            self.wait()

    def wait(self) -> None:
        """Commit the save in flight, if any: its shards finished, hashed (each rank a share), the manifest written
        last and the folder renamed by rank 0. Collective."""
        if self.pending is None:
            return
        future, tmp, target, head, after, config = self.pending
        self.pending = None
        info = self.info
        try:
            _together(lambda: future.result() if future is not None else None, info)
            barrier(info)  # every shard is on disk before any rank lists them
            # A peer may already be stamping its share, through a hidden temporary file beside the shard
            # (_files.atomic_path): every rank must list the same files, so temporaries are not listed.
            shards = sorted(p for p in (tmp / STATE).iterdir() if p.is_file() and not _temporary(p))
            share = shards[info.rank::info.world]
            # The variant spec into each shard's metadata (a rewrite of its header) before it is hashed
            mine = _together(lambda: stamp_spec(share, config) or ckpt.file_table(tmp, share), info)
            tables = _gather(mine, info)

            def finish():
                files = {k: v for t in tables for k, v in t.items()}
                files.update(ckpt.file_table(tmp, [p for p in tmp.iterdir() if p.is_file()]))
                ckpt.commit(tmp, target, head, dict(sorted(files.items())))
                if after is not None:
                    after()

            _together(finish, info, run=info.is_main)
        except BaseException:
            self._discard(tmp)
            raise

    def _discard(self, tmp: Path) -> None:
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)


def _temporary(p: Path) -> bool:
    return p.name.startswith(".") and p.name.endswith(".tmp")


def on_main(fn, info: DistInfo) -> Any:
    """fn() on rank 0 while the others wait; a failure there raises on every rank (collective)."""
    return _together(fn, info, run=info.is_main)


def load_groups(path: Path) -> list[dict]:
    groups = json.loads((Path(path) / "optimizer.json").read_text())["param_groups"]
    return [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in groups]


def newest(run_dir: Path, info: DistInfo, log=print) -> Path:
    """The checkpoint to resume from, verified by rank 0 alone (hashing every shard on every rank would read the
    whole state world times) after it cleared what a killed save left; every rank gets its path. Collective."""
    found = _together(lambda: str(ckpt.newest_intact(run_dir, log=log)), info, run=info.is_main)
    return Path(_gather(found, info)[0])


def restore(path: Path, model, optimizer, info: DistInfo, tied: bool, config=None) -> dict[str, Any]:
    """Load checkpoint `path` (either format) into the wrapped model and optimizer. Returns {"trainer_state",
    "rng", "read": {"bytes_per_rank", "bytes_total"}} (bytes of tensor data each rank read; collective).
    config: the model's config, whose variant spec a sharded checkpoint's must equal."""
    path = Path(path)
    manifest, problem = ckpt._manifest(path)
    if problem:
        raise ValueError(f"checkpoint {path}: {problem}")
    if manifest["format"] == ckpt.EXPORT:
        raise ValueError(f"{path} holds the model alone (an export: no optimizer, RNG or data position); resume from "
                         "a step checkpoint under checkpoints/")
    if config is not None:  # the variant the shards / weights files record, before any tensor is read
        if manifest["format"] == 1:
            check_weights_spec(config, weights_files(path), f"the checkpoint {path}")
        else:
            check_spec(path, config)
    if manifest["format"] == 1:  # a full checkpoint (final/, or a run from before sharding): every rank reads all
        state = ckpt.load_training_state(path)
        missing = load_full_state(model, optimizer, state["model"], state["optimizer"])
        lost = {n for n in missing if not (tied and n.endswith("lm_head.weight"))}
        if lost:
            raise ValueError(f"checkpoint {path} lacks weights {sorted(lost)[:5]}")
        size = sum(t.numel() * t.element_size() for t in state["model"].values()) + sum(
            t.numel() * t.element_size() for s in state["optimizer"]["state"].values() for t in s.values()
            if isinstance(t, torch.Tensor))
        read = {"bytes_per_rank": [size] * info.world, "bytes_total": size}
        return {"trainer_state": state["trainer_state"], "rng": state["rng"], "read": read}
    for rel in ("optimizer.json", "rng.safetensors", "trainer_state.json"):
        if rel not in manifest["files"]:
            raise ValueError(f"checkpoint {path}: its {ckpt.MANIFEST} does not list {rel}; resume from another "
                             "checkpoint")
    with checkpoint_view(path, announce=False) as view:  # newest_intact named what the manifest does not list
        return _restore_sharded(view, model, optimizer, info)


def _restore_sharded(view: Path, model, optimizer, info: DistInfo) -> dict[str, Any]:
    """restore() of a sharded checkpoint, read through `view` (its listed files only)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state, _, aliases = sharded_state(model, optimizer)
    reader = reader_for(view / STATE)
    torch.distributed.checkpoint.load(state, storage_reader=reader, no_dist=not info.enabled)
    state["model"].update({name: state["model"][kept] for name, kept in aliases.items()})
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={**state["optim"], "param_groups": load_groups(view)})
    return {"trainer_state": json.loads((view / "trainer_state.json").read_text()),
            "rng": load_file(str(view / "rng.safetensors")),
            "read": {"bytes_per_rank": _gather(reader.bytes_read, info), "bytes_total": reader.bytes_total}}
