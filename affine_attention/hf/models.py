"""Config and model classes of converted checkpoints (model type `affine_<family>` for every family of
families.FAMILIES, e.g. `affine_llama`), which hf.registration registers with AutoConfig / AutoModelForCausalLM.

Each is a subclass of the transformers class that adds no modeling code: the model's `__init__` builds the
original architecture and attaches the variants recorded in `config.affine_attention` before transformers loads
the weights. The distinct model type is what makes a converted checkpoint fail loudly, never load as softmax,
where this package is not imported. Checkpoints also carry a small `auto_map` loader file (the Hub path), so
`trust_remote_code=True` loads them wherever `affine-attention` is installed.

The variant spec is also recorded in the metadata of every weights file (`save_pretrained`, every shard); loading
refuses a config.json whose spec differs from it (see `check_weights_spec`).
"""
from __future__ import annotations

import inspect
import os
import warnings

from safetensors import SafetensorError

from . import attention, families, layers, spec_record

HUB_LOADER_FILE = "affine_attention_loader.py"
_PENDING_ATTR = "_affine_attention_pending_record"  # (folder, weights variant, file states before the save)
_READ_FILES_ATTR = "_affine_attention_read_files"  # the weights files transformers read in from_pretrained


class AffineConfigMixin:
    """Marks a converted config; `config.affine_attention` holds {"variant": name, "options": {...}}."""

    def to_dict(self):
        # Saved so that loading through the original class (e.g. LlamaForCausalLM.from_pretrained) fails too:
        # without this package the implementation is unknown, with it the attention refuses unconverted layers.
        out = super().to_dict()
        out["attn_implementation"] = attention.ATTN_IMPLEMENTATION
        return out

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        # These classes write their own `auto_map` loader: transformers' copy of this module would not import.
        return None


class AffineModelMixin:
    """What a converted causal LM adds to its transformers class: variants built from the config in `__init__`
    (so weights load into them), checks after loading, the fixed attention implementation and the Hub loader."""

    def __init__(self, config, *args, **kwargs):
        spec = layers.spec_from_config(config)
        requested = config._attn_implementation
        if requested not in (None, attention.ATTN_IMPLEMENTATION):
            raise ValueError(f"a model converted to the {spec['variant']!r} attention variant runs with "
                             f"attn_implementation='{attention.ATTN_IMPLEMENTATION}', got {requested!r}; "
                             "leave `attn_implementation` unset")
        config._attn_implementation = attention.ATTN_IMPLEMENTATION
        super().__init__(config, *args, **kwargs)
        layers.attach_variants(self, spec)

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        if attn_implementation != attention.ATTN_IMPLEMENTATION:
            raise ValueError(
                f"this model runs the {self.config.affine_attention['variant']!r} attention variant, which only the "
                f"'{attention.ATTN_IMPLEMENTATION}' implementation computes; got {attn_implementation!r}")
        return super().set_attn_implementation(attn_implementation, *args, **kwargs)

    def init_continuous_batching(self, *args, **kwargs):
        # generate_batch, the continuous-batching context manager and `transformers serve` all start here; their
        # paged attention kernels compute plain softmax.
        raise ValueError(attention.SERVING_REFUSAL)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' loader, then checks it does not make: every variant weight must come from the
        checkpoint (a missing one would run with an arbitrary value), and config.json's variant spec must be the
        one recorded in the weights files' metadata (an edited config would run another attention function)."""
        want_info = kwargs.pop("output_loading_info", False)
        where = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        try:
            model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        except SafetensorError as err:
            raise ValueError(f"cannot read the weights of the checkpoint at {where}: {err}. A safetensors file there "
                             "is truncated or corrupted; save or download it again") from err
        layers.check_saved_spec(model.config, str(where))
        unexpected = [k for k in info.get("unexpected_keys", ()) if f".{layers.VARIANT_ATTR}." in k]
        if unexpected:
            raise ValueError(f"the checkpoint at {where} holds {len(unexpected)} attention-variant weight(s) that its "
                             f"config's variant ({model.config.affine_attention['variant']!r}, options "
                             f"{model.config.affine_attention.get('options')}) does not use, e.g. "
                             f"{sorted(unexpected)[:3]}; its config.json does not match its weights (was "
                             f"{layers.CONFIG_KEY} edited?)")
        missing = [k for k in info.get("missing_keys", ()) if f".{layers.VARIANT_ATTR}." in k]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weight(s) of its attention variant "
                             f"({model.config.affine_attention['variant']!r}), e.g. {sorted(missing)[:3]}; it is "
                             "incomplete or was not saved from a converted model")
        files = model.__dict__.pop(_READ_FILES_ATTR, None)
        if files is not None:
            spec_record.check_weights_spec(model.config, files, str(where))
        elif kwargs.get("state_dict") is None:
            # Only a transformers version that reads weights without `_load_pretrained_model` gets here.
            warnings.warn(f"{where}: transformers loaded these weights by a route affine_attention does not see, so "
                          f"the variant spec recorded in their metadata was not compared with config.json",
                          stacklevel=2)
        return (model, info) if want_info else model

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, *args, **kwargs):
        # transformers resolves which files it reads (local folder or Hub cache, subfolder, variant, index); noting
        # them here lets from_pretrained check exactly those. A pickle is refused before torch.load could run it.
        files = [str(f) for f in checkpoint_files or ()]
        pickles = [f for f in files if not f.endswith(".safetensors")]
        if pickles:
            raise ValueError(f"the weights of this converted checkpoint are not safetensors ({pickles[0]}); "
                             "affine_attention never loads pickled weights (unpickling runs arbitrary code): save the "
                             "model with save_pretrained, which writes safetensors")
        model.__dict__[_READ_FILES_ATTR] = files
        return super(AffineModelMixin, type(model))._load_pretrained_model(model, state_dict, checkpoint_files,
                                                                            *args, **kwargs)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel"):
        return None  # see AffineConfigMixin.register_for_auto_class

    @classmethod
    def hub_auto_map(cls) -> dict[str, str]:
        module = HUB_LOADER_FILE[:-3]
        return {"AutoConfig": f"{module}.{cls.config_class.__name__}",
                "AutoModelForCausalLM": f"{module}.{cls.__name__}"}

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save, then the variant spec written into the metadata of every weights file it wrote."""
        self.config.auto_map = self.hub_auto_map()
        given = inspect.signature(super().save_pretrained).bind(save_directory, *args, **kwargs).arguments
        if given.get("is_main_process", True) and not os.path.isfile(save_directory):
            # Written first so that `push_to_hub=True`, which uploads from inside save_pretrained, includes it.
            os.makedirs(save_directory, exist_ok=True)
            write_hub_loader(save_directory)
            self.__dict__[_PENDING_ATTR] = (os.fspath(save_directory), given.get("variant"),
                                            spec_record.file_states(save_directory))
        try:
            result = super().save_pretrained(save_directory, *args, **kwargs)
            self._record_spec_in_weights()
        finally:
            self.__dict__.pop(_PENDING_ATTR, None)
        return result

    def _upload_modified_files(self, working_dir, *args, **kwargs):
        # save_pretrained(push_to_hub=True) uploads from inside transformers' save: the spec goes in first.
        self._record_spec_in_weights()
        return super()._upload_modified_files(working_dir, *args, **kwargs)

    def _record_spec_in_weights(self) -> None:
        pending = self.__dict__.get(_PENDING_ATTR)
        if pending is None:
            return
        directory, variant, before = pending
        record = spec_record.spec_metadata(layers.spec_from_config(self.config))
        for path in spec_record.weights_files(directory, variant):
            # A file this save did not rewrite (e.g. a model.safetensors left by an unsharded save before a sharded
            # one) keeps its own record: stamping it would vouch for weights this model did not write.
            if before.get(path) != spec_record.file_state(path):
                spec_record.stamp(path, record)


# --- the variant spec in the weights files --------------------------------------------------------------------
# config.json is a text file people edit; the safetensors headers travel with the weights and are written only by
# save_pretrained. For parameter-free variants (softmax, off_by_one, ...) no weight tells them apart, so this record
# is what catches a config edited from one to another.
def write_hub_loader(directory: str | os.PathLike) -> str:
    """Write the loader that `auto_map` points to; transformers imports it only under trust_remote_code=True."""
    names = ", ".join(f"{c.__name__}, {m.__name__}" for c, m in _CLASSES.values())
    text = (
        '"""Loader of an Affine-Scaled Attention checkpoint, written by affine_attention.\n\n'
        "Load it with `import affine_attention` then `AutoModelForCausalLM.from_pretrained(path)`, or with\n"
        "`trust_remote_code=True`, which imports this file. Both need `pip install affine-attention`.\n"
        '"""\n'
        f"from affine_attention.hf.models import {names}  # noqa: F401\n"
    )
    path = os.path.join(directory, HUB_LOADER_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _converted_classes(family: families.Family) -> tuple[type, type]:
    """(config class, model class) of converted checkpoints of `family`: model type `affine_<name>`, subclasses of
    the family's transformers classes that add nothing but the mixins. Module-level names (AffineLlamaConfig,
    AffineLlamaForCausalLM, ...) so that pickling and the Hub loader file find them."""
    config_base, model_base = family.classes()
    config_cls = type(f"Affine{config_base.__name__}", (AffineConfigMixin, config_base),
                      {"model_type": f"affine_{family.name}", "__module__": __name__})
    model_cls = type(f"Affine{model_base.__name__}", (AffineModelMixin, model_base),
                     {"config_class": config_cls, "__module__": __name__})
    globals()[config_cls.__name__], globals()[model_cls.__name__] = config_cls, model_cls
    return config_cls, model_cls


# family -> the transformers class convert() accepts, and the (config, model) classes it turns it into
_ORIGINALS = {name: f.classes()[1] for name, f in families.FAMILIES.items() if f.available()}
_CLASSES = {name: _converted_classes(families.FAMILIES[name]) for name in _ORIGINALS}


def supported_families() -> list[str]:
    return families.family_names()


def family_of(model) -> str:
    """The family of an unconverted supported causal LM (or of a subclass of one); ValueError for anything else,
    converted models included."""
    if isinstance(model, AffineModelMixin) or getattr(getattr(model, "config", None), layers.CONFIG_KEY, None):
        spec = getattr(model.config, layers.CONFIG_KEY, None) or {}
        raise ValueError(f"this model is already converted (variant {spec.get('variant')!r}); converting twice "
                         "would stack variants: convert the original model instead")
    by_class = {cls: family for family, cls in _ORIGINALS.items()}
    for cls in type(model).__mro__:  # the nearest supported ancestor
        if cls in by_class:
            return by_class[cls]
    names = ", ".join(c.__name__ for c in _ORIGINALS.values())
    raise ValueError(f"cannot convert {type(model).__name__}: supported models are {names} and their subclasses "
                     "(the causal LM classes, as built by AutoModelForCausalLM); a model with another attention "
                     "module needs an entry in affine_attention/hf/families.py (docs/architecture.md, 'A model "
                     "family'); `affine-attention families` lists what is supported")


def affine_classes(family: str, model_cls: type | None = None):
    """(config class, model class) of converted checkpoints of `family`. For `model_cls`, a user's subclass of the
    family's transformers class, the model class is a subclass of both, so its own methods keep running in memory;
    its checkpoints record the family (they load as the family's converted class: code is never saved)."""
    config_cls, converted = _CLASSES[family]
    if model_cls is None or model_cls is _ORIGINALS[family]:
        return config_cls, converted
    if model_cls not in _SUBCLASSES:
        _SUBCLASSES[model_cls] = type(f"Affine{model_cls.__name__}", (converted, model_cls), {
            "__module__": model_cls.__module__, "__doc__": f"{model_cls.__name__} converted by affine_attention.",
            "hub_auto_map": converted.hub_auto_map})  # the Hub loader names the family's class
    return config_cls, _SUBCLASSES[model_cls]


_SUBCLASSES: dict[type, type] = {}


def converted_classes() -> list[tuple[type, type]]:
    """(config class, model class) of every family's converted checkpoints, for hf.registration."""
    return list(_CLASSES.values())
