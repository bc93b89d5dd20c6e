"""Reading a run's config: a preset or TOML file, `--set` overrides and [model].preset expanded, then type-checked
(unknown keys and bad types refused) and validated into a RunConfig."""
from __future__ import annotations

import copy
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from ..hf.families import family_names, family_of_config
from ..hf.presets import PRESETS
from .config import RunConfig, check_ranges


# ---------------------------------------------------------------------------------------------------------------
# Building dataclasses from plain dicts, with type checks and clear errors.

def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (list,):
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            dict: "a table"}.get(hint, getattr(hint, "__name__", str(hint)))


def _convert(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ValueError(f"config key {where!r} must be {_type_name(hint)}; got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return None if value is None else _convert(value, args[0], where)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"config key {where!r} must be {_type_name(hint)}; got {value!r}")
        inner = typing.get_args(hint)[0]
        return [_convert(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        dict: isinstance(value, dict),
    }.get(hint)
    if ok is None:
        raise TypeError(f"unsupported config field type {hint!r} at {where!r}")
    if not ok:
        raise ValueError(f"config key {where!r} must be {_type_name(hint)}; got {value!r}")
    return float(value) if hint is float else value


def from_dict(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Build dataclass `cls` from `data`; unknown keys and wrong types raise ValueError listing the valid keys."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        table = f"[{where}]" if where else "the top level"
        raise ValueError(f"unknown config key(s) {[prefix + k for k in unknown]} in {table}; "
                         f"valid keys: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    base = cls()
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(hints[name]):
            if not isinstance(value, dict):
                raise ValueError(f"config key {key!r} must be a table, got {value!r}")
            # Nested tables merge key by key over the field's default (e.g. [data.eval] keeps split="validation").
            merged = dataclasses.asdict(getattr(base, name))
            merged.update(value)
            value = from_dict(hints[name], merged, key)
        else:
            value = _convert(value, hints[name], key)
        setattr(base, name, value)
    return base


def _parse_value(text: str) -> Any:
    """A --set value: a TOML value when it parses as one, else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=value` overrides to a raw config dict (typed later by from_dict)."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects key=value (e.g. train.steps=100), got {item!r}")
        key, text = item.split("=", 1)
        parts = [p for p in key.strip().split(".")]
        if not all(parts):
            raise ValueError(f"--set key {key!r} is not a dotted key such as optim.lr")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {key}: {p!r} is not a table")
        node[parts[-1]] = _parse_value(text.strip())
    return data


# ---------------------------------------------------------------------------------------------------------------
# Presets and files.

def _preset_dirs() -> list[Path]:
    here = Path(__file__).resolve().parent.parent  # the affine_attention package
    return [here / "configs"]


def preset_names() -> list[str]:
    names = set()
    for d in _preset_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.toml"))
    return sorted(names)


def resolve_config_path(spec: str) -> Path:
    """A file path, or the name of a preset in the package folder `affine_attention/configs/`."""
    p = Path(spec).expanduser()
    if p.is_file():
        return p
    if "/" not in spec and not spec.endswith(".toml"):
        for d in _preset_dirs():
            if (d / f"{spec}.toml").is_file():
                return d / f"{spec}.toml"
    raise ValueError(f"config {spec!r} is neither a file nor a preset name; presets: {', '.join(preset_names())}")


def load_config(spec: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a preset or TOML file (default: the `tiny` preset), apply --set overrides, type-check, validate.

    A config file is TOML with the tables of config.py ([model], [variant], [data], [data.train], [data.eval],
    [optim], [schedule], [train], [kd], [compare]); every key has a default, so a file names only what it changes.
    `--set a.b=value` overrides one key; the value is parsed as a TOML value (`3`, `1e-3`, `true`, `"x"`,
    `["softmax", "affine"]`) and falls back to a bare string, then checked against the field's type.
    Named presets (`tiny`, `kd-smollm2`, `paper-0.5b`, ...) live in the package folder `affine_attention/configs/`
    (package data, so they work after `pip install`); `configs/` at the repository root is a link to that folder
    for reading and editing. `spec` is a preset name or a file path.
    """
    path = resolve_config_path(spec or "tiny")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not valid TOML: {err}") from None
    return config_from_dict(apply_overrides(data, list(overrides or [])), source=str(path))


# The architecture table's transformers keys -> [model] keys. Token ids come from the tokenizer, never the table;
# any other key of a row goes to [model].extra unchanged (e.g. Mistral's sliding_window).
_PRESET_KEYS = {"model_type": "arch", "vocab_size": "vocab_size", "hidden_size": "hidden_size",
                "intermediate_size": "intermediate_size", "num_hidden_layers": "num_layers",
                "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
                "tie_word_embeddings": "tie_embeddings", "rope_theta": "rope_theta", "rope_scaling": "rope_scaling",
                "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps"}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def preset_model_keys(name: str) -> dict[str, Any]:
    """The [model] keys of architecture `name` in `affine_attention.hf.presets.PRESETS`."""
    if name not in PRESETS:
        raise ValueError(f"model.preset {name!r} is not in the architecture table; choose one of {sorted(PRESETS)}")
    row = copy.deepcopy(PRESETS[name])  # the caller may change the dicts it gets (rope_scaling)
    keys = {_PRESET_KEYS[k]: v for k, v in row.items() if k in _PRESET_KEYS}
    # the family name, which may differ from the model type (gemma3_text -> gemma3)
    keys["arch"] = family_of_config(types.SimpleNamespace(model_type=row["model_type"])).name
    extra = {k: v for k, v in row.items() if k not in _PRESET_KEYS and k not in _TOKEN_IDS}
    return {**keys, "extra": extra} if extra else keys


def _expand_preset(data: dict[str, Any]) -> dict[str, Any]:
    """[model].preset filled in: the row's keys first, then the table's own keys on top ("extra" merged)."""
    model = data.get("model")
    if not isinstance(model, dict) or not model.get("preset"):
        return data
    if not isinstance(model["preset"], str):
        raise ValueError(f"config key 'model.preset' must be a string; got {model['preset']!r}")
    base = preset_model_keys(model["preset"])
    merged = {**base, **model}
    if isinstance(model.get("extra"), dict):
        merged["extra"] = {**base.get("extra", {}), **model["extra"]}
    return {**data, "model": merged}


def _check_init_from(data: dict[str, Any]) -> None:
    """With [model].init_from the checkpoint defines the architecture: any size set beside it would be ignored."""
    model = data.get("model")
    if not isinstance(model, dict) or not model.get("init_from"):
        return
    other = sorted(set(model) - {"init_from", "function_preserving"})
    if other:
        raise ValueError(f"model.init_from = {model['init_from']!r} takes the architecture from that model; remove "
                         f"{', '.join('model.' + k for k in other)} (or drop init_from to train from scratch)")


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> RunConfig:
    try:
        _check_init_from(data)
        cfg = from_dict(RunConfig, _expand_preset(data))
        _backcopy_tokenizer(cfg)
        validate(cfg)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    return cfg


def _backcopy_tokenizer(cfg: RunConfig) -> None:
    """A backcopy source brings its own vocabulary: data.tokenizer "default" becomes that vocabulary's spec, and
    any other tokenizer, or mixing backcopy with a text source, is refused (the ids would mean different tokens)."""
    from .data_backcopy import SPEC_PREFIX, tokenizer_spec

    d = cfg.data
    kinds = {d.train.kind == "backcopy", d.eval.kind == "backcopy"}
    if kinds == {False}:
        if d.tokenizer.startswith(SPEC_PREFIX):
            raise ValueError(f"data.tokenizer {d.tokenizer!r} belongs to data.train.kind = 'backcopy'")
        return
    if len(kinds) == 2:
        raise ValueError("data.train and data.eval must both be of kind 'backcopy' or neither (one vocabulary)")
    spec = tokenizer_spec(d.backcopy)
    if d.tokenizer not in ("default", spec):
        raise ValueError(f"data.tokenizer must be 'default' (or {spec!r}) with a backcopy source, got {d.tokenizer!r}")
    if cfg.model.init_from:
        raise ValueError("a backcopy source trains from scratch on its own vocabulary; unset model.init_from")
    d.tokenizer = spec


def validate(cfg: RunConfig) -> None:
    """Checks that need no torch: every numeric key within its declared range (config.check_ranges), then what
    relates keys to each other (batch arithmetic, head counts, sources, KD settings)."""
    check_ranges(cfg)
    t, d, k, m = cfg.train, cfg.data, cfg.kd, cfg.model
    if not m.init_from and m.arch not in family_names():
        raise ValueError(f"model.arch = {m.arch!r} is not a supported family; choose one of {family_names()} "
                         "(`affine-attention families`)")
    if d.seq_len > m.max_position_embeddings:
        raise ValueError(f"data.seq_len ({d.seq_len}) exceeds model.max_position_embeddings "
                         f"({m.max_position_embeddings}); lower data.seq_len or raise model.max_position_embeddings")
    if t.global_batch % t.micro_batch:
        raise ValueError(f"train.global_batch ({t.global_batch}) must be a multiple of train.micro_batch "
                         f"({t.micro_batch}) times the number of ranks")
    if m.num_heads % m.num_kv_heads:
        raise ValueError(f"model.num_heads ({m.num_heads}) must be a multiple of model.num_kv_heads ({m.num_kv_heads})")
    if not m.head_dim and m.hidden_size % m.num_heads:
        raise ValueError(f"model.hidden_size ({m.hidden_size}) is not divisible by model.num_heads ({m.num_heads}); "
                         "set model.head_dim")
    for src, name in ((d.train, "data.train"), (d.eval, "data.eval")):
        if src.kind == "files" and not src.paths:
            raise ValueError(f"{name}.kind = 'files' needs {name}.paths (a list of files or glob patterns)")
        if src.kind == "tokens" and len(src.paths) != 1:
            raise ValueError(f"{name}.kind = 'tokens' needs {name}.paths = [the folder written by "
                             f"`affine-attention prepare-data`], one folder; got {src.paths}")
        if src.kind == "hub" and not src.name:
            raise ValueError(f"{name}.kind = 'hub' needs {name}.name (a datasets hub name)")
        if src.kind in ("corpus", "backcopy") and src.split not in ("train", "validation"):
            raise ValueError(f"{name}.split must be 'train' or 'validation' for kind {src.kind!r}, got {src.split!r}")
    if k.enabled and not k.teacher:
        raise ValueError("kd.enabled = true needs kd.teacher (a folder, hub name, *.gguf file or alias)")
    if k.enabled and k.cache and k.top_k == 0:
        raise ValueError("kd.cache = true stores top-k teacher logits: set kd.top_k (e.g. 64)")
    if not cfg.compare.variants:
        raise ValueError("compare.variants must name at least one variant")
    if not m.init_from:
        check_model_settings(m)


def check_model_settings(m) -> None:
    """[model] as transformers will read it, checked before any data or model is built: the transformers config is
    built here, and a rope type its rotary embedding does not know (a KeyError deep in model construction
    otherwise) is refused naming model.rope_scaling."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from .model import hf_config

    rope_type = m.rope_scaling.get("rope_type", m.rope_scaling.get("type", "default"))
    known = ["default", *ROPE_INIT_FUNCTIONS]
    if rope_type not in known:
        raise ValueError(f"model.rope_scaling.rope_type = {rope_type!r} is not a rope type transformers knows; choose "
                         f"one of {known} or remove model.rope_scaling")
    try:
        hf_config(m)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"transformers rejects the [model] settings ({type(err).__name__}: {err}); fix [model] "
                         "(model.rope_scaling, model.extra, ...)") from None
