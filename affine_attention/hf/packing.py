"""Padding-free packed batches in converted models: recognise packing the way transformers signals it and hand the
variants `document_ids`, so attention runs on the structured fast paths instead of a dense (T, S) mask.

transformers treats a batch as packed when `position_ids` restart inside a row while there is no attention mask and
no cache (`masking_utils.find_packed_sequence_indices`); `DataCollatorWithFlattening` produces exactly that, plus
`cu_seq_lens_q/k` when asked for FlashAttention kwargs, and trl's padding-free collator adds `seq_idx` (each token's
document id) as well. A forward pre-hook on the decoder stack applies the same
rule: it derives document ids (B, T) and passes them as the missing `attention_mask`, in a 4D integer form
(`documents_mask`) that transformers hands every layer unchanged (it never materialises the dense block-diagonal
mask) and that every decoder layer forwards by name, also those that drop **kwargs.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from transformers.masking_utils import find_packed_sequence_indices
from transformers.utils import is_tracing

# One dict per model forward that transformers hands every attention call: the memo in which the seam keeps each
# layer kind's parsed mask, so masks are parsed and checked once per forward (hf/attention.py `_layer_mask`).
FORWARD_KWARG = "affine_attention_forward_masks"
_HOOK_ATTR = "_affine_attention_packing_hook"
# Keywords that carry packed sequence boundaries; the seam refuses them where this hook did not turn them into
# document ids (beside an attention mask or a cache), rather than drop them.
BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")


def documents_mask(documents: Tensor) -> Tensor:
    """(B, S) document ids -> the (B, 1, 1, S) int64 `attention_mask` that carries packed documents to every
    attention call: transformers hands a 4D mask to the layers unchanged, and every decoder layer forwards
    `attention_mask` by name (keywords in **kwargs are dropped by some, e.g. StableLM's). Integer, where masks are
    bool or float: the seam reads it as documents under the causal rule, never as a visibility mask."""
    return documents.long()[:, None, None, :]


def documents_from_cu_seqlens(cu_seqlens: Tensor, T: int) -> Tensor:
    """cu_seqlens: (n_docs + 1,) cumulative lengths of a flattened batch of one row (FlashAttention's varlen
    format, as DataCollatorWithFlattening emits) -> document ids (1, T) int64."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seq_lens_k must be a 1D tensor of cumulative sequence lengths, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if not is_tracing(cu_seqlens) and int(cu_seqlens[-1]) != T:
        raise ValueError(f"cu_seq_lens_k ends at {int(cu_seqlens[-1])} but the packed row has {T} tokens; pass the "
                         "cu_seq_lens of this batch (one flattened row)")
    pos = torch.arange(T, device=cu_seqlens.device)
    return (torch.searchsorted(cu_seqlens[1:-1].to(pos.dtype), pos, right=True))[None]


def _check_same_boundaries(seq_idx: Tensor, docs: Tensor) -> None:
    """cu_seq_lens and seq_idx given together (trl's padding-free collator) must describe the same documents."""
    if is_tracing(seq_idx):
        return
    if seq_idx.shape != docs.shape or not torch.equal(seq_idx[:, 1:] != seq_idx[:, :-1], docs[:, 1:] != docs[:, :-1]):
        raise ValueError("seq_idx and cu_seq_lens_k describe different packed documents; pass the boundaries of "
                         "this batch (or only one of them)")


def _will_have_cache(decoder: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether the decoder stack runs with a cache: one given, or one it creates (use_cache, as LlamaModel does)."""
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        return True
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(decoder.config, "use_cache", False)
    return bool(use_cache) and not (decoder.training and getattr(decoder, "gradient_checkpointing", False))


def detect_packing(decoder: nn.Module, args: tuple, kwargs: dict[str, Any]):
    """Forward pre-hook (with_kwargs) on the decoder stack (model.model): a fresh per-forward mask memo for the
    attention calls, and document ids for packed rows (see the module docstring)."""
    kwargs = dict(kwargs)
    kwargs[FORWARD_KWARG] = {}
    if args or kwargs.get("attention_mask") is not None or _will_have_cache(decoder, kwargs):
        return args, kwargs
    ids = kwargs.get("input_ids")
    embeds = kwargs.get("inputs_embeds")
    ref = ids if ids is not None else embeds
    if ref is None:
        return args, kwargs
    B, T = ref.shape[0], ref.shape[1]
    cu, seq_idx = kwargs.get("cu_seq_lens_k"), kwargs.get("seq_idx")
    if cu is not None:
        if B != 1:
            raise ValueError(f"cu_seq_lens_k describes one flattened row, but the batch has {B} rows")
        docs = documents_from_cu_seqlens(cu, T)
        if seq_idx is not None:
            _check_same_boundaries(seq_idx, docs)
    elif seq_idx is not None:
        docs = seq_idx  # each token's document id, exactly as given (the ops check its shape, type and order)
    elif kwargs.get("position_ids") is not None:
        # transformers' own rule (a position that does not continue the previous one starts a document), so the
        # two can never disagree; None: positions never restart, not packed.
        docs = find_packed_sequence_indices(kwargs["position_ids"])
        if docs is None:
            return args, kwargs
        docs = docs.expand(B, T)
    else:
        return args, kwargs
    kwargs["attention_mask"] = documents_mask(docs)
    return args, kwargs


def attach(model: nn.Module) -> None:
    """Install the packing pre-hook on the decoder stack of a converted *ForCausalLM (idempotent)."""
    decoder = model.model
    if getattr(decoder, _HOOK_ATTR, None) is None:
        setattr(decoder, _HOOK_ATTR, decoder.register_forward_pre_hook(detect_packing, with_kwargs=True))
