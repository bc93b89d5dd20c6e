"""`affine-attention export`: one checkpoint of a run (a sharded step checkpoint or final/) as a transformers-loadable
folder (model safetensors with the variant, config, tokenizer) with a manifest (format EXPORT), written atomically
into a new folder; and a run's final/, the same export of its last step checkpoint. Only files a manifest lists are
read."""
from __future__ import annotations

import shutil
from pathlib import Path

from .._files import check_writable, notice_unlisted
from ..hf.sharded import MAX_SHARD_BYTES, checkpoint_view, write_pretrained
from . import checkpoint as ckpt

# The training state of a full checkpoint that a transformers folder does not carry.
_TRAINING_FILES = {"optimizer.safetensors", "optimizer.json", "rng.safetensors", "trainer_state.json", ckpt.MANIFEST}


def pick(run_dir: Path, step: int | None) -> Path:
    """The intact checkpoint of `run_dir` at `step` (final/ when it is that step), or the newest intact one."""
    found = ckpt.candidates(run_dir, exports=True)
    if not found:
        raise ValueError(f"export: no checkpoint in {run_dir} (looked in checkpoints/step-* and final/); "
                         "pass the --out folder of a train run")
    if step is not None:
        at = [p for s, p in found if s == step]
        if not at:
            raise ValueError(f"export: {run_dir} has no checkpoint of step {step}; it has steps "
                             f"{sorted({s for s, _ in found})}")
        found = [(step, at[0])]
    for _, path in found:
        problem = ckpt.verify(path)
        if problem is None:
            return path
        if step is not None:
            raise ValueError(f"export: checkpoint {path} is damaged ({problem}); pick another --step")
    raise ValueError(f"export: no intact checkpoint in {run_dir}; every one failed verification")


def export(run_dir: str | Path, out: str | Path, step: int | None = None,
           max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write checkpoint `step` (default: the newest intact) of `run_dir` to the new folder `out`; returns the
    checkpoint it read. Single process; a sharded checkpoint's model is streamed in weights files of at most
    `max_shard_bytes` (hf.sharded.write_pretrained), never built whole."""
    run_dir, out = Path(run_dir), Path(out)
    if out.exists():
        raise ValueError(f"export: --out {out} exists; choose a new folder (nothing is overwritten)")
    check_writable(out)
    path = pick(run_dir, step)
    manifest = ckpt._manifest(path)[0]
    tmp = ckpt.temporary(out)
    tmp.mkdir(parents=True)
    try:
        if manifest["format"] in (1, ckpt.EXPORT):  # a transformers folder: the listed files but the training state
            notice_unlisted(path, ckpt.unlisted(path), ckpt.MANIFEST)
            for rel in manifest["files"]:
                if "/" not in rel and rel not in _TRAINING_FILES:
                    shutil.copy2(path / rel, tmp / rel)
        else:
            _write_sharded(path, tmp, max_shard_bytes)
        # Its own manifest, as final/'s: the list of what the folder holds, for every reader that checks one
        ckpt.commit(tmp, out, {"format": ckpt.EXPORT, "step": manifest["step"]}, ckpt.file_table(tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _write_sharded(path: Path, tmp: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """The model streamed from the shards one weights file at a time (never built whole), then the tokenizer."""
    from transformers import AutoTokenizer

    write_pretrained(path, tmp, max_shard_bytes)
    with checkpoint_view(path, announce=False) as view:  # write_pretrained named what the manifest does not list
        AutoTokenizer.from_pretrained(view).save_pretrained(tmp)


def write_final(step_path: Path, target: Path) -> None:
    """A run's final/: the model of its step checkpoint `step_path` (read from its shards, the optimizer's left on
    disk) as a transformers folder, with the run's trainer_state.json and a manifest (format EXPORT), committed
    atomically. One process (rank 0)."""
    step_path, target = Path(step_path), Path(target)
    tmp = ckpt.temporary(target)
    tmp.mkdir(parents=True)
    try:
        _write_sharded(step_path, tmp)
        shutil.copy2(step_path / "trainer_state.json", tmp)  # the run's config and step (analyze reads its data)
        step = ckpt._manifest(step_path)[0]["step"]
        ckpt.commit(tmp, target, {"format": ckpt.EXPORT, "step": step}, ckpt.file_table(tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
