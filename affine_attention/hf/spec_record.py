"""The attention-variant spec recorded in the safetensors metadata of every weights file a converted model saves, so
that an edit of config.json cannot make the weights load with another attention function (checked on load)."""
from __future__ import annotations

import json
import os
import shutil
import struct
import warnings
from importlib import metadata as _dist

from safetensors import safe_open

from .._files import atomic_file
from . import layers

SPEC_METADATA_KEY = "affine_attention.spec"  # canonical JSON of {"variant": name, "options": {...}}
SPEC_FORMAT_KEY = "affine_attention.spec_format"
VERSION_KEY = "affine_attention.version"  # informational: which release wrote it (named in errors)
SPEC_FORMAT = 1  # raise when the record's layout changes; loading refuses formats it does not know
SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME = "model.safetensors", "model.safetensors.index.json"  # transformers'


def _canonical(spec) -> str:
    return json.dumps(layers.make_spec(spec["variant"], spec.get("options")), sort_keys=True, separators=(",", ":"))


def _library_version() -> str:
    try:
        return _dist.version("affine-attention")
    except _dist.PackageNotFoundError:
        return "unknown"


def spec_metadata(spec) -> dict[str, str]:
    """The safetensors metadata entries that record a variant spec (safetensors metadata values are strings)."""
    return {SPEC_METADATA_KEY: _canonical(spec), SPEC_FORMAT_KEY: str(SPEC_FORMAT), VERSION_KEY: _library_version()}


def _add_variant(name: str, variant: str | None) -> str:
    """transformers' weights-file naming: variant "fp16" before the last suffix (model.fp16.safetensors,
    model.safetensors.index.fp16.json)."""
    if not variant:
        return name
    head, tail = name.rsplit(".", 1)
    return f"{head}.{variant}.{tail}"


def weights_files(directory, variant: str | None = None) -> list[str]:
    """The safetensors files a load of `directory` reads, in transformers' order of preference: the single weights
    file, else every shard its index names. Empty when there is neither."""
    single = os.path.join(directory, _add_variant(SAFE_WEIGHTS_NAME, variant))
    if os.path.isfile(single):
        return [single]
    index = os.path.join(directory, _add_variant(SAFE_WEIGHTS_INDEX_NAME, variant))
    if not os.path.isfile(index):
        return []
    with open(index, encoding="utf-8") as f:
        shards = sorted(set(json.load(f).get("weight_map", {}).values()))
    return [p for p in (os.path.join(directory, s) for s in shards) if os.path.isfile(p)]


def file_state(path: str):
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def file_states(directory) -> dict[str, tuple]:
    if not os.path.isdir(directory):
        return {}
    paths = (os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))
    return {p: file_state(p) for p in paths}


def stamp(path: str, record: dict[str, str]) -> None:
    """Add `record` to the metadata of the safetensors file at `path`, replacing the file atomically. The header
    (8-byte little-endian length, then JSON) grows, so the tensor bytes are copied after it unchanged: their offsets
    count from the end of the header, so they stay valid. Streamed, so memory stays small for any shard size."""
    with open(path, "rb") as src:
        (n,) = struct.unpack("<Q", src.read(8))
        header = json.loads(src.read(n))
        meta = header.get("__metadata__") or {}
        if all(meta.get(k) == v for k, v in record.items()):
            return
        header["__metadata__"] = {**meta, **record}
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header with spaces so the data stays 8-byte aligned
        with atomic_file(path) as dst:
            dst.write(struct.pack("<Q", len(raw)) + raw)
            shutil.copyfileobj(src, dst, 1 << 24)
    if recorded_spec(path) != json.loads(record[SPEC_METADATA_KEY]):  # read back through safetensors itself
        raise RuntimeError(f"{path}: the variant spec written into its metadata does not read back; save again")


def recorded_spec(path) -> dict | None:
    """The variant spec recorded in the metadata of one safetensors file; None for a file without a record (saved
    before affine_attention wrote one, or not by a converted model). ValueError for an unreadable record."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if SPEC_METADATA_KEY not in meta and SPEC_FORMAT_KEY not in meta:
        return None
    written_by = f"affine-attention {meta.get(VERSION_KEY, '(unknown version)')}"
    fmt = meta.get(SPEC_FORMAT_KEY)
    if fmt != str(SPEC_FORMAT):
        newer = fmt is not None and fmt.isdigit() and int(fmt) > SPEC_FORMAT
        raise ValueError(f"{path}: its metadata records the attention-variant spec in format {fmt!r}, written by "
                         f"{written_by}; this version reads format {SPEC_FORMAT}. "
                         + ("Upgrade affine-attention to load it" if newer else
                            "The metadata is damaged: save the model again from a trusted copy"))
    try:
        raw = json.loads(meta[SPEC_METADATA_KEY])
        return json.loads(_canonical(raw))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: the attention-variant spec in its metadata ({meta.get(SPEC_METADATA_KEY)!r}, "
                         f"written by {written_by}) is unreadable here: {err}. If a newer affine-attention wrote it, "
                         "upgrade; otherwise save the model again from a trusted copy") from None


def check_weights_spec(config, files, where: str) -> None:
    """Refuse weights whose recorded spec differs from the config's, naming both specs, the file and the fix. Files
    without any record (saved by a version that wrote none) load with a warning: they hold nothing to compare."""
    files = [str(f) for f in files]
    if not files:
        return  # weights passed in memory (state_dict=...): no file to check
    want = json.loads(_canonical(layers.spec_from_config(config)))
    recorded = {f: recorded_spec(f) for f in files}
    unrecorded = [f for f, spec in recorded.items() if spec is None]
    if len(unrecorded) == len(files):
        warnings.warn(f"{where}: the weights files carry no record of their attention-variant spec (saved by an "
                      f"affine-attention release that wrote none), so config.json alone decides that this model runs "
                      f"{want}; if that is right, save it again with save_pretrained to record it", stacklevel=3)
        return
    if unrecorded:
        raise ValueError(f"{where}: {len(unrecorded)} of its {len(files)} weights files carry no attention-variant "
                         f"spec while the others do (e.g. {unrecorded[0]}): the files come from different saves. "
                         "Restore the checkpoint from one save_pretrained, or convert and save the model again")
    for path, spec in recorded.items():
        if spec != want:
            raise ValueError(
                f"{where}: config.json's {layers.CONFIG_KEY} is {want}, but the weights were saved with {spec} "
                f"(recorded in the metadata of {path}); loading would run another attention function than the one "
                f"the weights were trained with. Restore config.json's {layers.CONFIG_KEY} to {spec} (the file "
                "save_pretrained wrote), or, to change the variant, convert the original unconverted model with "
                f"affine_attention.convert(model, {want['variant']!r}, ...) and save_pretrained it")
