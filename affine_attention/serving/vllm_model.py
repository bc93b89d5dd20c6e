"""vLLM model classes of converted checkpoints: vLLM's own model of the family, with each layer's attention call
wrapped by `VariantAttention`, which runs the variant's prologue, vLLM's attention (paged KV cache, every mask it
applies) and the variant's epilogue. Imported by vLLM (lazily, by name) where it builds a model.

The affine combine needs, per query, the mean of the values it may see. Softmax with equal logits returns exactly
that mean, so one all-zero query head is appended to each KV-head group in the same attention call: vLLM's kernel
then averages the visible values under whatever mask it applies (causal, sliding window, chunked prefill, prefix
caching), at (G + 1) / G of the attention cost for G query heads per KV head. Sinks are passed to vLLM's attention
as its native `sinks`; a backend without them is refused, never run without the sink.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os

import torch
from torch import Tensor, nn
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention

from ..hf import layers, spec_record
from ..hf.families import FAMILIES, family_of_config
from ..ops.epilogue import epilogue
from ..variants import AttentionShape, build_variant, get_variant
from ..variants.base import Prologue
from .vllm import SERVED, architecture

logger = logging.getLogger(__name__)
#: Prologue fields this module applies; a variant whose prologue sets any other field is refused.
_APPLIED = {"alpha", "alpha_ma", "gate", "sinks", "bias_norm"}
_HELP = ("serve it with transformers (`affine_attention` + AutoModelForCausalLM.from_pretrained and generate), "
         "or open an issue naming the family and variant")


class Refused(ValueError):
    """A converted checkpoint this plugin cannot serve exactly (family, variant, backend or parallel layout)."""


def servable(spec: dict, family: str) -> str | None:
    """Why the plugin cannot serve `spec` ({"variant", "options"}) on `family`, or None when it can. Read from the
    variant's declared facts: its kernel needs, and that it keeps the base class's fast path (`attend`)."""
    from ..variants import AttentionVariant

    cls = get_variant(spec["variant"])
    if family not in SERVED:
        return (f"affine-attention's vLLM plugin serves the families {sorted(SERVED)}; this checkpoint is a "
                f"{family!r} model")
    if cls.attend is not AttentionVariant.attend:
        return (f"variant {cls.name!r} replaces the fast path (`attend`), so its math is not the prologue -> softmax "
                "-> epilogue this plugin runs")
    if cls.score is not AttentionVariant.score:
        return (f"variant {cls.name!r} changes how logits are made (the score hook), which vLLM's attention kernel "
                "does not apply")
    if cls.needs_lse and cls.uses_value_mean:
        return f"variant {cls.name!r} needs both a sink and the mean of visible V in one call (not implemented)"
    if spec["options"].get("bias_norm", "visible") != "visible":
        return (f"variant {cls.name!r} with bias_norm={spec['options']['bias_norm']!r} (an ablation) needs the full "
                "key length, which vLLM's attention does not expose")
    return None


class VariantAttention(nn.Module):
    """Replaces a layer's vLLM `Attention` (same layer name, so the same KV cache): q (N, Hq*D), k, v (N, Hkv*D)
    -> (N, Hq*D), the variant's attention output; N counts the tokens of every sequence in the step."""

    def __init__(self, old: Attention, variant: nn.Module, sinks: bool, mean_head: bool, config):
        super().__init__()
        self.variant_ref = [variant]  # the parameters live at self_attn.attn_variant (checkpoint names)
        self.Hq, self.Hkv, self.D = old.num_heads, old.num_kv_heads, old.head_size
        self.mean_head = mean_head
        # Filled by the sink variant's prologue once its weights are loaded (`refresh_sinks`); the kernel reads it.
        self.sink_logits = torch.zeros(self.Hq, dtype=torch.float32) if sinks else None
        name = old.layer_name
        context = config.compilation_config.static_forward_context
        del context[name]  # the replacement takes over this layer's name, hence its KV cache
        cap = getattr(old.impl, "logits_soft_cap", None) or None
        extra = {"sinks": self.sink_logits} if sinks else {}
        self.inner = Attention(self.Hq + (self.Hkv if mean_head else 0), self.D, old.impl.scale,
                               num_kv_heads=self.Hkv, cache_config=config.cache_config, quant_config=old.quant_config,
                               logits_soft_cap=cap, per_layer_sliding_window=old.sliding_window, prefix=name,
                               attn_type=old.attn_type, **extra)
        if sinks and not _takes_sinks(self.inner, self.sink_logits):
            raise Refused(f"vLLM's attention backend {self.inner.attn_backend.get_name()} has no attention sinks, "
                          f"which variant {variant.name!r} needs; serving without them would compute another "
                          "attention: choose a backend with sinks (the CPU backend has them)")
        self.x: Tensor | None = None  # the layer's attention input, set by the attention module just before

    def refresh_sinks(self) -> None:
        if self.sink_logits is not None:
            p = self.variant_ref[0].prologue(self.sink_logits.new_zeros(1, 1, self.variant_ref[0].shape.hidden_size),
                                             None)
            self.sink_logits.copy_(p.sinks.float())

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        x, self.x = self.x, None
        N, Hq, Hkv, D = q.shape[0], self.Hq, self.Hkv, self.D
        p = self.variant_ref[0].prologue(x[None], None)  # alpha (1, Hq, N), gate broadcastable to (1, Hq, N, D)
        if self.mean_head:  # one zero query after each group of G = Hq / Hkv heads: the mean of visible V
            q = torch.cat([q.view(N, Hkv, Hq // Hkv, D), q.new_zeros(N, Hkv, 1, D)], dim=2).reshape(N, -1)
        o = self.inner(q, k, v)
        m = None
        if self.mean_head:
            o = o.view(N, Hkv, Hq // Hkv + 1, D)
            m = o[:, :, -1].transpose(0, 1)[None]  # (1, Hkv, N, D)
            o = o[:, :, :-1]
        out = o.reshape(N, Hq, D).transpose(0, 1)[None]  # (1, Hq, N, D)
        if p.alpha is None and p.gate is None:
            return o.reshape(N, Hq * D)
        out = epilogue(out, alpha=p.alpha, alpha_ma=p.alpha_ma, gate=p.gate, v_mean=m, impl="eager")
        return out[0].transpose(0, 1).reshape(N, Hq * D)


def _takes_sinks(attn: Attention, sinks: Tensor) -> bool:
    """Whether `attn`'s backend applies the sink logits it was built with. CPU_ATTN applies them (as `s_aux`) without
    declaring `supports_sink`; its implementation then holds this very tensor."""
    return attn.attn_backend.supports_sink() or getattr(attn.impl, "sinks", None) is sinks


def _hidden_states_index(forward) -> int:
    params = [n for n in inspect.signature(forward).parameters if n != "self"]
    return params.index("hidden_states")


class _CaptureInput:
    """Mixed into a family's attention module: hands its input hidden states (N, hidden) to its VariantAttention."""

    def forward(self, *args, **kwargs):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[self._x_index]
        self.attn.x = x
        return super().forward(*args, **kwargs)


class AffineServingMixin:
    """What a converted model adds to vLLM's model of its family: the variants, built from config.affine_attention,
    in every attention layer; their weights from the checkpoint; the checks that it is served exactly."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        config = vllm_config.model_config.hf_config
        where = vllm_config.model_config.model
        spec = layers.spec_from_config(config)
        layers.check_saved_spec(config, str(where))
        family = family_of_config(config).name
        why = servable(spec, family)
        if why:
            raise Refused(f"{where}: cannot serve this {spec['variant']!r} checkpoint with vLLM: {why}; {_HELP}")
        if get_tensor_model_parallel_world_size() > 1 or get_pp_group().world_size > 1:
            raise Refused("affine-attention's vLLM plugin runs on one worker (tensor_parallel_size=1, "
                          "pipeline_parallel_size=1): splitting the variant's heads with their attention heads is "
                          "not implemented yet (docs/serving.md)")
        _check_weights_record(config, where)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        cls = get_variant(spec["variant"])
        for layer in self.model.layers:
            attn_module = layer.self_attn
            old = attn_module.attn
            shape = AttentionShape(config.hidden_size, old.num_heads, old.num_kv_heads, old.head_size)
            variant = build_variant(spec["variant"], shape, **spec["options"]).eval()
            probe = variant.prologue(torch.zeros(1, 1, config.hidden_size), None)
            extra = [f for f in Prologue._fields if f not in _APPLIED and getattr(probe, f) != Prologue._field_defaults[f]]
            if extra:
                raise Refused(f"{where}: variant {cls.name!r} sets {extra} in its prologue, which this plugin does not "
                              f"apply; {_HELP}")
            attn_module.add_module(layers.VARIANT_ATTR, variant)
            attn_module.attn = VariantAttention(old, variant, sinks=cls.needs_lse, mean_head=cls.uses_value_mean,
                                                config=vllm_config)
            base = type(attn_module)
            attn_module.__class__ = type(f"Affine{base.__name__}", (_CaptureInput, base),
                                         {"_x_index": _hidden_states_index(base.forward)})

    def load_weights(self, weights):
        """The family's loader for every original weight; the variant's own (`...self_attn.attn_variant.*`) here."""
        mine = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded = set()

        def originals():
            for name, tensor in weights:
                if f".{layers.VARIANT_ATTR}." not in name:
                    yield name, tensor
                elif name in mine or name in buffers:
                    (mine.get(name) if name in mine else buffers[name]).data.copy_(tensor)
                    loaded.add(name)
                elif not name.endswith(".alpha_acc"):  # the training accumulator: no use when serving
                    raise Refused(f"the checkpoint holds {name}, which its variant "
                                  f"({self.config.affine_attention['variant']!r}) does not use; its config.json "
                                  "does not match its weights")

        loaded |= set(super().load_weights(originals()))
        missing = sorted(n for n in (*mine, *buffers) if f".{layers.VARIANT_ATTR}." in n and n not in loaded
                         and not n.endswith(".alpha_acc"))
        if missing:
            raise Refused(f"the checkpoint lacks {len(missing)} weight(s) of its attention variant, e.g. {missing[:3]}")
        for module in self.modules():
            if isinstance(module, VariantAttention):
                module.refresh_sinks()
        return loaded


def _check_weights_record(config, where) -> None:
    """The variant spec recorded in the weights files must be config.json's (an edited config would serve another
    attention function than the one the weights were trained with)."""
    if os.path.isdir(str(where)):
        spec_record.check_weights_spec(config, spec_record.weights_files(str(where)), str(where))
    else:
        logger.warning("%s is not a local folder: the variant spec recorded in its weights files was not compared "
                       "with config.json (serve a downloaded folder to have it checked)", where)


class _RefusingMixin:
    """A converted architecture of a family this plugin does not serve: refuses to start, saying why."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        config = vllm_config.model_config.hf_config
        spec = layers.spec_from_config(config)
        raise Refused(f"{vllm_config.model_config.model}: cannot serve this {spec['variant']!r} checkpoint with "
                      f"vLLM: {servable(spec, family_of_config(config).name)}; {_HELP}")


def _model_class(family: str) -> type:
    module, name = SERVED.get(family, SERVED["llama"])  # refused families: any causal LM, for vLLM's inspection
    base = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
    mixin = AffineServingMixin if family in SERVED else _RefusingMixin
    return type(architecture(family), (mixin, base), {"__module__": __name__})


for _family in FAMILIES:
    globals()[architecture(_family)] = _model_class(_family)
