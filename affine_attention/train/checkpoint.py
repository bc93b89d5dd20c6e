"""Atomic, verifiable training checkpoints: the manifest, the atomic commit and the recovery every format shares, and
the full format (1): a transformers-loadable safetensors folder plus the training state, written by rank 0.

The final/ of runs from before the export format, and their step checkpoints (both still resume), hold:
  config.json, model*.safetensors, generation_config.json  save_pretrained output (AutoModel loadable)
  tokenizer files                                          the run's tokenizer
  optimizer.safetensors, optimizer.json                    AdamW tensors by parameter name / param_groups
  rng.safetensors                                          torch CPU (and CUDA) RNG state
  trainer_state.json                                       step, data position, wall time, tokens, config
  MANIFEST.json                                            written last: size and sha256 of every other file
It is written into a hidden temporary folder, every file fsynced, then renamed into place (and the parent fsynced),
so a crash never leaves a half-written folder under a checkpoint name. Step checkpoints are sharded (format 2,
checkpoint_dcp.py) and share the manifest, commit and recovery. Loading verifies the manifest; a damaged
newest checkpoint is reported and the next newest intact one is used. Nothing is unpickled: safetensors and JSON.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .._files import unlisted as _unlisted
from ..hf.sharded import MANIFEST
# 1: a full folder written by rank 0 (this module); 2: sharded, every rank writes its part (checkpoint_dcp.py);
# 3 (EXPORT): final/, the model alone as a transformers folder (export.write_final): loaded, never resumed.
EXPORT = 3
FORMATS = (1, 2, EXPORT)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _flatten_optimizer(osd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for name, state in osd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}\x1f{key}"] = value.contiguous()
            else:
                scalars[f"{name}\x1f{key}"] = value
    return tensors, {"param_groups": osd["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[str, dict[str, Any]] = {}
    for flat, value in list(tensors.items()) + list(meta["scalars"].items()):
        name, key = flat.split("\x1f")
        state.setdefault(name, {})[key] = value
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def save(target: Path, *, model, model_sd: dict, optim_sd: dict, tokenizer, trainer_state: dict) -> Path:
    """Write a full (format 1) checkpoint atomically to `target` (replacing an older one of the same name). Rank 0
    only. Runs write sharded step checkpoints (checkpoint_dcp.py) and final/ as an export (export.write_final).

    model: the unwrapped transformers model (for its config); model_sd, optim_sd: full CPU state dicts.
    """
    target = Path(target)
    tmp = temporary(target)
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(tmp, state_dict=dict(model_sd))  # a copy: save_pretrained consumes its dict
        tokenizer.save_pretrained(tmp)
        tensors, meta = _flatten_optimizer(optim_sd)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "optimizer.json").write_text(json.dumps(meta, indent=1))
        write_rng(tmp)
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        commit(tmp, target, {"format": 1, "step": trainer_state["step"]}, file_table(tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def temporary(target: Path, suffix: str | None = None) -> Path:
    """The hidden folder a save of `target` writes into (`recover_partial` knows the pattern)."""
    return Path(target).parent / f".tmp-{Path(target).name}-{suffix or uuid.uuid4().hex[:8]}"


def write_rng(folder: Path) -> None:
    """The torch CPU (and CUDA) RNG state: every rank draws from one stream, so rank 0's is the run's."""
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["torch_cuda"] = torch.cuda.get_rng_state()
    save_file(rng, str(Path(folder) / "rng.safetensors"))


def file_table(folder: Path, only: list[Path] | None = None) -> dict[str, dict]:
    """{relative path: {"size", "sha256"}} of the files in `folder` (or of `only`), each fsynced first."""
    folder = Path(folder)
    files = {}
    for path in sorted(only if only is not None else (p for p in folder.rglob("*") if p.is_file())):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[str(path.relative_to(folder))] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    return files


def commit(tmp: Path, target: Path, head: dict, files: dict[str, dict]) -> None:
    """Write the manifest (head + files) last into `tmp`, then rename `tmp` to `target` (an older folder of that
    name is moved aside first and removed after) and fsync the parent: a crash leaves the old folder or the new."""
    with open(tmp / MANIFEST, "w") as f:
        f.write(json.dumps({**head, "files": files}, indent=1))
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    old = None
    if target.exists():  # a folder cannot be renamed onto a non-empty one: move the old one aside first
        old = target.parent / f".old-{target.name}-{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
    os.replace(tmp, target)
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _manifest(path: Path) -> tuple[dict | None, str | None]:
    """(manifest, None) when MANIFEST.json is well formed, else (None, why not). Well formed: a JSON object with the
    known format, an integer step and `files` mapping relative paths to {"size": int, "sha256": str}."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except FileNotFoundError:
        return None, f"{MANIFEST} is missing (the save did not finish)"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, f"{MANIFEST} is not valid JSON"
    if not isinstance(manifest, dict):
        return None, f"{MANIFEST} is not a JSON object (got {type(manifest).__name__})"
    if manifest.get("format") not in FORMATS:
        return None, f"unknown checkpoint format {manifest.get('format')!r} (this version reads {FORMATS})"
    step, files = manifest.get("step"), manifest.get("files")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None, f"{MANIFEST} has no valid 'step' (got {step!r})"
    if not isinstance(files, dict) or not files:
        return None, f"{MANIFEST} has no 'files' table"
    for rel, info in files.items():
        if (not isinstance(info, dict) or isinstance(info.get("size"), bool) or not isinstance(info.get("size"), int)
                or not isinstance(info.get("sha256"), str)):
            return None, f"{MANIFEST} entry {rel!r} is not {{'size': int, 'sha256': str}}"
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            return None, f"{MANIFEST} entry {rel!r} points outside the checkpoint"
    return manifest, None


def verify(path: Path) -> str | None:
    """None when the checkpoint is intact, else why not (missing or malformed manifest, missing file, size or hash
    mismatch)."""
    path = Path(path)
    manifest, problem = _manifest(path)
    if problem:
        return problem
    for rel, info in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != info["size"]:
            return f"{rel} has {f.stat().st_size} bytes, the manifest says {info['size']} (truncated?)"
        if _sha256(f) != info["sha256"]:
            return f"{rel} does not match its sha256 in the manifest (corrupted)"
    return None


def unlisted(path: Path) -> list[str]:
    """Files in a checkpoint folder that its manifest does not list (never loaded)."""
    manifest, _ = _manifest(path)
    return _unlisted(path, manifest["files"] if manifest else (), own=(MANIFEST,))


def candidates(run_dir: Path, exports: bool = False) -> list[tuple[int, Path]]:
    """Checkpoint folders of a run as (step, path), newest first (`final` counts with its step); an export (final/
    of format EXPORT, the model alone) only with `exports`."""
    found = []
    for p in list((Path(run_dir) / "checkpoints").glob("step-*")) + [Path(run_dir) / "final"]:
        if not p.is_dir():
            continue
        manifest, _ = _manifest(p)
        if manifest is not None and manifest["format"] == EXPORT and not exports:
            continue
        if manifest is not None:
            step = manifest["step"]
        else:
            try:
                step = int(p.name.split("-")[1])
            except (ValueError, IndexError):
                step = -1
        found.append((step, p))
    return sorted(found, key=lambda sp: (sp[0], sp[1].name == "final"), reverse=True)


def recover_partial(run_dir: Path, log=print) -> None:
    """Deal with what a save killed mid-way leaves (hidden .tmp-NAME-* / .old-NAME-* folders), saying what it does:
    a finished temporary folder whose target is missing takes its name (only the rename was lost), an old copy
    whose replacement is missing is put back, everything else is removed."""
    for parent in (Path(run_dir), Path(run_dir) / "checkpoints"):
        if not parent.is_dir():
            continue
        for kind in (".tmp-", ".old-"):
            for p in sorted(parent.glob(f"{kind}*")):
                name = p.name[len(kind):].rsplit("-", 1)[0]
                target = parent / name
                if p.is_dir() and not target.exists() and verify(p) is None:
                    os.replace(p, target)
                    log(f"checkpoint {target} restored from {p.name}, left by a save that was killed")
                else:
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink(missing_ok=True)
                    log(f"removed {p}, a partial checkpoint left by a save that was killed")


def newest_intact(run_dir: Path, log=print) -> Path:
    """The newest checkpoint that verifies; says which damaged ones it skipped. Raises if none is intact.
    (Call `recover_partial` first, on one process.)"""
    found = candidates(run_dir)
    if not found:
        raise ValueError(f"--resume: no checkpoint in {run_dir} (looked in checkpoints/step-* and final/)")
    for step, path in found:
        problem = verify(path)
        if problem is None:
            extra = unlisted(path)
            if extra:
                log(f"checkpoint {path}: ignoring {len(extra)} file(s) its {MANIFEST} does not list: {extra[:5]}")
            return path
        log(f"checkpoint {path} is damaged: {problem}; trying the next newest")
    raise ValueError(f"--resume: no intact checkpoint in {run_dir}; every one failed verification (see above)")


def load_training_state(path: Path) -> dict[str, Any]:
    """Read a verified format-1 checkpoint: model and optimizer state dicts, RNG, trainer_state. No pickles; only the
    files its manifest lists."""
    path = Path(path)
    manifest, problem = _manifest(path)
    if problem:
        raise ValueError(f"checkpoint {path}: {problem}")
    listed = manifest["files"]
    model_sd: dict[str, torch.Tensor] = {}
    for rel in sorted(r for r in listed if "/" not in r and r.startswith("model") and r.endswith(".safetensors")):
        model_sd.update(load_file(str(path / rel)))
    for rel in ("optimizer.safetensors", "optimizer.json", "rng.safetensors", "trainer_state.json"):
        if rel not in listed:
            raise ValueError(f"checkpoint {path}: its {MANIFEST} does not list {rel}")
    optim_sd = _unflatten_optimizer(load_file(str(path / "optimizer.safetensors")),
                                    json.loads((path / "optimizer.json").read_text()))
    return {"model": model_sd, "optimizer": optim_sd, "rng": load_file(str(path / "rng.safetensors")),
            "trainer_state": json.loads((path / "trainer_state.json").read_text())}


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` step checkpoints (final/ is never deleted)."""
    steps = sorted((Path(run_dir) / "checkpoints").glob("step-*"))
    for old in steps[: max(len(steps) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)
