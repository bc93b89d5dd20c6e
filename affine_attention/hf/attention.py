"""The transformers seam: an attention function and a mask function registered under one implementation name.

Converted models set `config._attn_implementation = ATTN_IMPLEMENTATION`; their attention layers then call
`attention_forward`, which hands (q, k, v, x, mask) to the layer's `attn_variant` module. The mask function keeps
masks structured (None, or a (B, 1, 1, S) key mask, both meaning "causal + padding") so the variants keep their
fast paths; only sliding windows, packed sequences, static caches and custom patterns become dense masks.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from transformers.masking_utils import (
    causal_mask_function,
    prepare_padding_mask,
    sdpa_mask,
)
from transformers.utils import is_tracing

from ..ops.call import AttentionCall, make_score
from ..ops.masks import KeyRuns, Varlen, parse_mask, read_key_runs
from . import cache as value_cache
from . import packing
from .families import HONOURED_KWARGS, INERT_KWARGS, REQUIRED_VALUES, family_of_config, masked_window

ATTN_IMPLEMENTATION = "affine_attention"
# Keyword arguments the attention module's pre-hook adds; transformers forwards them to `attention_forward`.
X_KWARG = "affine_attention_x"
CACHE_KWARG = "affine_attention_cache"
TRUSTED_KWARG = "affine_attention_cache_trusted"
KV_TRUSTED_KWARG = "affine_attention_cache_kv_trusted"
# The attention module's attribute holding where the sliding window its decoder masks but does not pass on comes from
# (Family.mask_window), set by `convert`; the window itself is read from the config on every call.
LAYER_WINDOW_ATTR = "affine_attention_window"
# Every keyword `attention_forward` reads or may ignore; any other is refused (see `_check_kwargs`).
_KNOWN_KWARGS = frozenset(HONOURED_KWARGS) | frozenset(INERT_KWARGS) | {
    X_KWARG, CACHE_KWARG, TRUSTED_KWARG, KV_TRUSTED_KWARG, packing.FORWARD_KWARG}


# Why a converted model is not run by transformers' continuous batching (generate_batch, `transformers serve`), nor by
# any attention implementation other than this seam's.
SERVING_REFUSAL = ("transformers' continuous batching (generate_batch, `transformers serve`) runs its own paged "
                   "attention kernels, which compute plain softmax, not this model's attention variant; serve "
                   "converted models with vLLM (the serving path for them), and batch here with model.generate on "
                   "left-padded prompts")


def capture_attention_input(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
    """Forward pre-hook (with_kwargs=True) on a converted attention module.

    The attention function only receives q, k, v and the mask, but alpha and gates need x: (B, T, hidden), the
    layer's input. Passing it on as a keyword (rather than stashing it on the module) keeps this correct when
    activation checkpointing re-runs the layer and traceable by torch.compile. It also passes the cache object
    and tells the running value sum whether the cache is still the one it summed (before `cache.update`).
    """
    implementation = getattr(module.config, "_attn_implementation", None)
    if implementation != ATTN_IMPLEMENTATION:
        # The private field was overwritten (set_attn_implementation refuses): the layer would run `implementation`,
        # plain softmax, and never call the variant.
        raise ValueError(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) holds an attention "
                         f"variant but its config's attention implementation is {implementation!r}, which would "
                         f"compute plain softmax; set it back with model.config._attn_implementation = "
                         f"'{ATTN_IMPLEMENTATION}'. " + (SERVING_REFUSAL if "paged" in str(implementation) else ""))
    x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    kwargs = dict(kwargs)
    kwargs[X_KWARG] = x
    kwargs[CACHE_KWARG] = cache
    kwargs[TRUSTED_KWARG] = cache is not None and value_cache.before_update(cache, module.layer_idx)
    kwargs[KV_TRUSTED_KWARG] = cache is not None and value_cache.kv_before_update(cache, module.layer_idx)
    return args, kwargs


class KeyPadding(Tensor):
    """What the registered mask function returns for a padded batch: key padding under the causal rule.

    A (B, 1, 1, S) bool tensor of a type of its own. A tensor, because transformers reads back what its mask function
    returned (generate builds the masks of a static cache ahead and hands them to the model, whose own mask code then
    asks `.ndim` and `.shape`); a type of its own, because a (B, 1, 1, S) bool tensor that reaches the attention
    function is otherwise a user's own mask, which transformers' SDPA reads without the causal rule (each query sees
    every unmasked key): only the type tells the two apart, also in a traced graph. It rides in `attention_mask`, the
    argument every decoder layer forwards by name. Torch functions are disabled on it, so every op on it returns a
    plain tensor (nothing downstream ever computes on this type), and the seam reads the facts riding beside it:
    keys: the plain (B, 1, 1, S) bool tensor, True on real keys;
    runs: the KeyRuns read from `keys` when the mask function ran eagerly (also when only the decoder layers are
    compiled), so that compiled layers, which cannot read values, know them; None where it was traced."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    keys: Tensor | None = None
    runs: KeyRuns | None = None

    @staticmethod
    def of(keys: Tensor, runs: KeyRuns | None = None) -> "KeyPadding":
        """keys: (B, 1, 1, S) bool -> the seam's mask object. Contiguous, so transformers' `.contiguous()` (generate
        calls it on every mask it builds) hands back this object, not a plain tensor with another meaning."""
        keys = keys.contiguous()
        mask = keys.as_subclass(KeyPadding)
        mask.keys, mask.runs = keys, runs
        return mask


def _key_padding(mask: KeyPadding) -> tuple[Tensor, KeyRuns | None]:
    """(keys (B, 1, 1, S) plain bool, runs) of the seam's mask object; a KeyPadding made by anything but `of` (its
    facts lost) is still key padding, its runs unknown."""
    if mask.keys is None:
        return mask.as_subclass(Tensor), None
    return mask.keys, mask.runs


def _variant_mask(mask, B: int, T: int, S: int, training: bool):
    """HF mask -> (attn_mask for the variant, is_causal, token_mask (B, T) or None, keys (B|1, S) or None,
    documents (B|1, S) or None, KeyRuns of attn_mask or None).

    None: plain causal. KeyPadding (made by `structured_mask`): key padding under the causal rule. A (B|1, 1, 1, S)
    integer tensor (the packing hook's `packing.documents_mask`): packed documents under the causal rule. Any 4D
    boolean mask, including a user's own (B|1, 1, 1, S) or (B|1, 1|Hq, T, S), transformers hands over unchanged and
    its SDPA uses as given, without the causal rule (a (B, 1, 1, S) mask lets each query see every unmasked key):
    so does this, in eager and compiled code alike.
    token_mask, for the alpha_ma statistic, is only computed in training. keys: the key padding of a KeyPadding
    (what a decoding cache's running sum of V compares between steps: one object per mask, so every layer compares
    the same pair once per model forward).
    """
    if mask is None:
        return None, True, None, None, None, None
    if isinstance(mask, KeyPadding):
        keys, runs = _key_padding(mask)
        token_mask = keys[:, 0, 0, S - T:].expand(B, T) if training and S >= T else None
        return keys, True, token_mask, keys[:, 0, 0, :], None, runs
    if not isinstance(mask, Tensor) or mask.dim() != 4:
        raise ValueError(f"affine_attention expects a 4D boolean attention mask (B, 1, T, S) or None, got "
                         f"{type(mask).__name__} of shape {tuple(getattr(mask, 'shape', ()))}")
    if not (mask.is_floating_point() or mask.is_complex() or mask.dtype == torch.bool):
        if tuple(mask.shape[1:]) != (1, 1, S) or mask.shape[0] not in (1, B) or T != S:
            raise ValueError(f"an integer 4D attention_mask is read as packed document ids (B, 1, 1, S) of a batch "
                             f"without a cache (packing.documents_mask); got shape {tuple(mask.shape)}, T = {T}, "
                             f"S = {S}")
        return None, True, None, None, mask[:, 0, 0, :], None
    if mask.dtype != torch.bool:
        raise ValueError(f"affine_attention expects a boolean 4D mask (True = may attend), got dtype {mask.dtype}; "
                         "pass a 2D padding mask or a boolean 4D mask")
    key_only = mask.shape[-2] == 1 and mask.shape[1] == 1
    token_mask = None
    if training and mask.shape[1] == 1 and S >= T:
        if key_only:
            token_mask = mask[:, 0, 0, S - T:].expand(B, T)
        elif mask.shape[-2] == T:
            # A real query sees its own key (under padding masks only padded keys are hidden), so the diagonal
            # (bottom-right aligned) marks the real tokens for the alpha_ma statistic.
            idx = torch.arange(T, device=mask.device)
            token_mask = mask[:, 0, idx, idx + (S - T)].expand(B, T)
    # One query (decoding, static caches included): bottom-right causal hides nothing, so both readings coincide and
    # the key form keeps windows and the running sum of V on their fast paths.
    if key_only and T == 1:
        return mask, True, token_mask, mask[:, 0, 0, :], None, None
    return mask, False, token_mask, None, None, None


def _layer_mask(masks: dict | None, attention_mask, query: Tensor, key: Tensor, training: bool,
                sliding_window: int | None, varlen: Varlen | None):
    """The layer's parsed mask (MaskSpec), token mask and key padding (see `_variant_mask`), made once per model
    forward: `masks` is that forward's memo (see packing.FORWARD_KWARG), every layer of one kind (full or sliding
    attention) receives the same mask object, and what kernels derive from the MaskSpec (varlen segments, a host
    check) is kept on it. A compiled graph makes it per layer at trace time, which costs nothing at run time. A
    decoder whose layers call self_attn without **kwargs drops the memo (and varlen): each layer then parses the
    same mask again, which costs time, never correctness (the mask itself rides in attention_mask)."""
    B, Hq, T, _ = query.shape
    S = key.shape[-2]
    if masks is not None and not torch.compiler.is_compiling():
        key_ = (id(attention_mask), sliding_window, B, Hq, T, S, training)
        hit = masks.get(key_)
        # The memo holds the object it was keyed by: its id cannot be reused during the forward.
        if hit is not None and hit[0] is attention_mask:
            return hit[1]
    attn_mask, is_causal, token_mask, keys, documents, runs = _variant_mask(attention_mask, B, T, S, training)
    if sliding_window is not None and not is_causal:
        raise ValueError(f"a sliding window ({sliding_window}) with a dense attention mask; pass the mask transformers "
                         "builds for the model")
    # Packed rows (see packing.py) and sliding windows stay structured: the variants get document ids / a window
    # instead of a dense (T, S) mask, so their fast paths run.
    spec = parse_mask(attn_mask, is_causal, B, Hq, T, S, query.device, window=sliding_window if is_causal else None,
                      document_ids=documents, varlen=varlen if documents is not None else None, key_runs=runs)
    result = (spec, token_mask, keys)
    if masks is not None and not torch.compiler.is_compiling():
        masks[key_] = (attention_mask, result)
    return result


def _varlen(kwargs: dict[str, Any]) -> Varlen | None:
    """transformers' FlashAttention kwargs of a packed batch (DataCollatorWithFlattening(return_flash_attn_kwargs=
    True)), made outside the model: the varlen segments without a host sync, also inside a compiled graph."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None:
        return None
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if isinstance(max_q, Tensor) or isinstance(max_k, Tensor):
        max_q, max_k = int(max_q), int(max_k)  # a host read, where a collator handed tensors
    return Varlen(cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k)


def _family_name(module: nn.Module) -> str:
    try:
        return family_of_config(module.config).name
    except (AttributeError, ValueError):
        return type(module).__name__


def _check_kwargs(module: nn.Module, kwargs: dict[str, Any], packed: bool) -> None:
    """A keyword this seam does not implement would otherwise be dropped silently (as Gemma 2's softcap once was):
    refuse it, naming it and the family, whatever its value (an inert-looking None today may carry math tomorrow).
    The rule is families.py's (HONOURED_KWARGS, INERT_KWARGS, REQUIRED_VALUES)."""
    unknown = sorted(set(kwargs) - _KNOWN_KWARGS)
    if unknown:
        raise ValueError(f"the {_family_name(module)} attention ({type(module).__name__}) passes {unknown} to its "
                         f"attention function, which affine_attention does not implement; computing without them "
                         f"would silently change the model (implemented: {sorted(HONOURED_KWARGS)}; known inert: "
                         f"{sorted(INERT_KWARGS)})")
    for name, (allowed, why) in REQUIRED_VALUES.items():
        value = kwargs.get(name)
        if value is not None and value != allowed:
            raise ValueError(f"{name}={value!r} reached the {_family_name(module)} attention: {why}")
    # Packed boundaries are read by the packing hook, which acts only without an attention mask and a cache (packed:
    # its documents arrived in attention_mask); keys that arrive anyway (beside a mask, or during generation) would
    # otherwise be dropped.
    if not packed:
        given = sorted(k for k in packing.BOUNDARY_KWARGS if kwargs.get(k) is not None)
        if given:
            raise ValueError(f"{given} (packed sequence boundaries) came with an attention mask or a cache; "
                             "affine_attention reads packed boundaries only from a padding-free batch (no "
                             "attention_mask, use_cache=False), as DataCollatorWithFlattening and trl's padding-free "
                             "collator produce it: drop the attention mask, or the boundary keys")


def _window(module: nn.Module, sliding_window: int | None) -> int | None:
    """The layer's sliding window: the one its attention passes, or (a family whose attention does not pass it,
    Family.mask_window) the one its decoder's mask applies, which is all transformers' eager attention reads: read
    from the config now, as the decoder's mask is, never a copy taken at conversion."""
    rule = getattr(module, LAYER_WINDOW_ATTR, None)
    if rule is None:
        return sliding_window
    masked = masked_window(rule, module.config, module.layer_idx)
    if sliding_window is not None and sliding_window != masked:
        raise ValueError(f"the {_family_name(module)} attention (layer {module.layer_idx}) passes sliding_window="
                         f"{sliding_window}, but its decoder masks a window of {masked}; the family table's "
                         "mask_window no longer describes the installed transformers")
    return masked


def unclassified_kwargs() -> list[str]:
    """The forward keywords the installed transformers declares (TransformersKwargs, FlashAttentionKwargs) or that
    its generate() hands every forward (the objects it pops as generation-mode arguments), which the seam's rule
    (families.py) does not classify: each would be refused at the first forward that carries it."""
    from transformers.generation.utils import GenerationMixin
    from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
    from transformers.utils.generic import TransformersKwargs

    class _Recorder(dict):  # records the names generate() pops as its own, generation-mode, keywords
        def pop(self, name, default=None):
            popped.add(name)
            return default

    popped: set[str] = set()
    GenerationMixin._extract_generation_mode_kwargs(None, None, _Recorder(), False, None, None)
    declared = set(TransformersKwargs.__annotations__) | set(FlashAttentionKwargs.__annotations__) | popped
    return sorted(declared - _KNOWN_KWARGS)


def attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, s_aux: Tensor | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers attention interface: query (B, Hq, T, D), key/value (B, Hkv, S, D) -> ((B, T, Hq, D), None).
    attention_mask: None, KeyPadding, packed documents (`packing.documents_mask`) or a 4D bool mask (`_variant_mask`);
    softcap: Gemma 2's logit cap; s_aux: (Hq,) GPT-OSS's learned sink logits. Builds the layer's AttentionCall
    once and hands it to the variant."""
    packed = isinstance(attention_mask, Tensor) and not attention_mask.is_floating_point() \
        and attention_mask.dtype != torch.bool
    _check_kwargs(module, kwargs, packed)
    variant = getattr(module, "attn_variant", None)
    if variant is None:
        hint = ("this looks like a converted checkpoint loaded through its original class; load it with "
                "`AutoModelForCausalLM.from_pretrained` after `import affine_attention`"
                if getattr(getattr(module, "config", None), "affine_attention", None) else
                "convert models with `affine_attention.convert(model, variant)` instead of setting it by hand")
        raise ValueError(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) has no attention "
                         f"variant, so the '{ATTN_IMPLEMENTATION}' attention implementation cannot run it: {hint}")
    x = kwargs.get(X_KWARG)
    if x is None:
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) was called without its input "
            "hidden states: the forward pre-hook added by `affine_attention.convert` is missing (were the module's "
            "hooks removed, or was `forward` called directly instead of the module?)")
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported by affine_attention variants; set "
                         "`config.attention_dropout = 0.0`")
    sliding_window = _window(module, sliding_window)
    device_type = query.device.type
    if device_type != "meta" and torch.is_autocast_enabled(device_type):  # autocast knows no meta device
        # Under autocast RoPE hands back float32 q and k while v stays in the autocast dtype; run the op, like
        # SDPA under autocast, in the autocast dtype (its sums still accumulate in float32).
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    T = query.shape[-2]
    mask, token_mask, keys = _layer_mask(kwargs.get(packing.FORWARD_KWARG), attention_mask, query, key,
                                         variant.training, sliding_window, _varlen(kwargs))
    v_mean = None
    cache = kwargs.get(CACHE_KWARG)
    if cache is not None and variant.uses_value_mean and mask.window is None and mask.causal:
        v_mean = value_cache.value_mean(cache, module.layer_idx, value, keys, T,
                                        variant.value_mean_norm,
                                        kwargs.get(TRUSTED_KWARG, False), kwargs.get(packing.FORWARD_KWARG))
    kv_nonfinite = None if cache is None else value_cache.nonfinite_heads(
        cache, module.layer_idx, key, value, T, kwargs.get(KV_TRUSTED_KWARG, False))
    call = AttentionCall.of(query, key, value, mask=mask, score=make_score(scaling, softcap, query.shape[-1]),
                            v_mean=v_mean, kv_nonfinite=kv_nonfinite)
    out = variant(call, x, token_mask=token_mask, model_sinks=s_aux)
    return out.transpose(1, 2).contiguous(), None


def structured_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int | Tensor = 0,
                  kv_offset: int | Tensor = 0, mask_function=causal_mask_function, attention_mask: Tensor | None = None,
                  local_size: int | None = None, allow_is_causal_skip: bool = True,
                  **kwargs) -> KeyPadding | Tensor | None:
    """The mask function registered with transformers. Returns None (plain causal), KeyPadding (causal + key
    padding) or a dense (B, 1, T, S) bool mask.

    The structured forms need the last query aligned with the last key (q_offset + T == kv_offset + S, true for
    dynamic caches and training) and a plain causal pattern: transformers signals pattern changes (packing, extra
    mask functions) with allow_is_causal_skip=False, as its own SDPA skip logic relies on. A sliding window
    counts as plain (the variants get it as `window`).
    """
    aligned = (isinstance(q_offset, int) and isinstance(kv_offset, int)
               and q_offset + q_length == kv_offset + kv_length)
    # A sliding window is plain too: the attention function receives it as `sliding_window` and hands the
    # variants `window=`, so only its padding part needs a mask here.
    plain = allow_is_causal_skip and aligned and (local_size is not None or mask_function is causal_mask_function)
    if not plain:
        kwargs.pop("allow_is_bidirectional_skip", None)
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         local_size=local_size, allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                         **kwargs)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is None:
        return None
    keys = padding[:, kv_offset:kv_offset + kv_length].to(torch.bool)[:, None, None, :]  # (B, 1, 1, S)
    # Read once per forward where values can be read (eager, also when only the decoder layers are compiled): an
    # all-True mask is dropped (windows and plain causal keep their dense kernels), and compiled layers get the runs.
    # Traced, reading would break the graph: the key mask is kept, its runs unknown.
    read = None if is_tracing(keys) else read_key_runs(keys)
    if read is not None and read[0]:
        return None
    return KeyPadding.of(keys, None if read is None else read[1])

