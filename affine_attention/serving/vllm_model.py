"""vLLM model classes of converted checkpoints: vLLM's own model of the family, with each layer's attention call
wrapped by `VariantAttention`, which runs the variant's prologue, vLLM's attention (paged KV cache, every mask it
applies) and the variant's epilogue. Imported by vLLM (lazily, by name) where it builds a model.

The affine combine needs, per query, the mean of the values it may see. Softmax with equal logits returns exactly
that mean, so one all-zero query head is appended to each KV-head group in the same attention call: vLLM's kernel
then averages the visible values under whatever mask it applies (causal, sliding window, chunked prefill, prefix
caching), at (G + 1) / G of the attention cost for G query heads per KV head. Sinks are passed to vLLM's attention
as its native `sinks`, in the dtype and under the head limit of the backend vLLM picks for the layer (vllm_sinks.py);
a backend that cannot take them is refused, never run without the sink. Under tensor parallelism each
rank holds its query heads' part of the variant weights, checked against the whole variant at load.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os

import torch
from torch import Tensor, nn
from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention

from ..hf import layers, spec_record
from ..hf.families import FAMILIES, family_of_config
from ..ops.epilogue import epilogue
from ..variants import AttentionShape, build_variant, get_variant
from ..variants.base import Prologue
from .vllm import SERVED, architecture
from .vllm_sinks import Refused, backend_key, sink_dtype

logger = logging.getLogger(__name__)
#: Prologue fields this module applies; a variant whose prologue sets any other field is refused.
_APPLIED = {"alpha", "alpha_ma", "gate", "sinks", "bias_norm"}
_HELP = ("serve it with transformers (`affine_attention` + AutoModelForCausalLM.from_pretrained and generate), "
         "or open an issue naming the family and variant")


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
        self.mean_head, self.model_dtype = mean_head, config.model_config.dtype
        heads = self.Hq + (self.Hkv if mean_head else 0)
        cap = getattr(old.impl, "logits_soft_cap", None) or None
        extra, key = {}, None
        self.sink_logits = None  # (Hq,) in the backend's sink dtype: filled once the weights are loaded (refresh_sinks)
        if sinks:
            # A backend outside SINK_SUPPORT is refused there (CPU_ATTN applies s_aux without declaring supports_sink,
            # so vLLM's own flag decides nothing here).
            backend, key = _sink_backend(old, self.model_dtype, cap)
            self.sink_logits = torch.zeros(self.Hq, dtype=sink_dtype(key, self.model_dtype, heads))
            extra = {"sinks": self.sink_logits, "attn_backend": backend}
        name = old.layer_name
        context = config.compilation_config.static_forward_context
        del context[name]  # the replacement takes over this layer's name, hence its KV cache
        self.inner = Attention(heads, self.D, old.impl.scale,
                               num_kv_heads=self.Hkv, cache_config=config.cache_config, quant_config=old.quant_config,
                               logits_soft_cap=cap, per_layer_sliding_window=old.sliding_window, prefix=name,
                               attn_type=old.attn_type, **extra)
        if sinks:
            ran = backend_key(backend.get_name(), getattr(self.inner.impl, "vllm_flash_attn_version", None))
            if ran != key:
                raise Refused(f"{name}: vLLM runs its attention as {ran}, not {key}, the backend its sinks were "
                              "made for")
        self.x: Tensor | None = None  # the layer's attention input, set by the attention module just before

    def refresh_sinks(self) -> None:
        if self.sink_logits is not None:
            variant = self.variant_ref[0]
            x = torch.zeros(1, 1, variant.shape.hidden_size, dtype=self.model_dtype, device=self.sink_logits.device)
            self.sink_logits.copy_(variant.prologue(x, None).sinks)  # converted to the backend's sink dtype

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        x, self.x = self.x, None
        p = self.variant_ref[0].prologue(x[None], None)  # alpha (1, Hq, N), gate broadcastable to (1, Hq, N, D)
        if self.mean_head:
            q = with_mean_heads(q, self.Hkv, self.D)
        return combine(self.inner(q, k, v), p, self.Hq, self.Hkv, self.D, self.mean_head)


def with_mean_heads(q: Tensor, Hkv: int, D: int) -> Tensor:
    """q (N, Hq*D) -> (N, (Hq + Hkv)*D): one zero query after each group of G = Hq / Hkv heads (its output: the mean
    of the values its group may see)."""
    N = q.shape[0]
    return torch.cat([q.view(N, Hkv, -1, D), q.new_zeros(N, Hkv, 1, D)], dim=2).reshape(N, -1)


def combine(o: Tensor, p: Prologue, Hq: int, Hkv: int, D: int, mean_head: bool) -> Tensor:
    """vLLM's attention output o (N, (Hq [+ Hkv])*D) -> the variant's (N, Hq*D): the package's epilogue with the
    prologue's alpha / gate and, with mean_head, the extra heads' outputs as the mean of visible V."""
    N = o.shape[0]
    m = None
    if mean_head:
        o = o.view(N, Hkv, Hq // Hkv + 1, D)
        m = o[:, :, -1].transpose(0, 1)[None]  # (1, Hkv, N, D)
        o = o[:, :, :-1]
    if p.alpha is None and p.gate is None:
        return o.reshape(N, Hq * D)
    out = o.reshape(N, Hq, D).transpose(0, 1)[None]  # (1, Hq, N, D)
    out = epilogue(out, alpha=p.alpha, alpha_ma=p.alpha_ma, gate=p.gate, v_mean=m, impl="eager")
    return out[0].transpose(0, 1).reshape(N, Hq * D)


def _sink_backend(old: Attention, model_dtype: torch.dtype, cap: float | None):
    """(backend class, SINK_SUPPORT key): the backend vLLM's selector picks for layer `old` with sinks (it may differ
    from the one picked without them), passed to the new Attention as is; for FlashAttention the version its
    implementation will run, as it asks for it (FA3 and FA4 take sinks in different limits)."""
    from vllm.v1.attention.selector import get_attn_backend

    backend = get_attn_backend(old.head_size, model_dtype, old.kv_cache_dtype, has_sink=True,
                               use_mm_prefix=old.use_mm_prefix, attn_type=old.attn_type,
                               has_sliding_window=old.sliding_window is not None)
    version = None
    if backend.get_name() == "FLASH_ATTN":
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

        version = get_flash_attn_version(head_size=old.head_size, has_sinks=True, requires_softcap=bool(cap),
                                         supports_fa4_hd256=True)
    return backend, backend_key(backend.get_name(), version)


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
        if get_pp_group().world_size > 1:
            raise Refused("affine-attention's vLLM plugin does not run pipeline parallelism (pipeline_parallel_size=1; "
                          "tensor_parallel_size may be > 1)")
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
        """The family's loader for every original weight; the variant's own (`...self_attn.attn_variant.*`) here,
        each cut to this rank's heads under tensor parallelism (`_rank_rows`), then checked (`_check_split`)."""
        mine = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded = set()
        ranks, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        whole: dict[str, Tensor] = {}  # the checkpoint's variant tensors, to check this rank's split against

        def originals():
            for name, tensor in weights:
                if f".{layers.VARIANT_ATTR}." not in name:
                    yield name, tensor
                elif name.endswith(".alpha_acc"):  # the training accumulator: no use when serving
                    continue
                elif name in mine or name in buffers:
                    target = mine.get(name) if name in mine else buffers[name]
                    target.data.copy_(_rank_rows(name, tensor, target, ranks, rank))
                    loaded.add(name)
                    if ranks > 1:
                        whole[name] = tensor.detach().to("cpu", copy=True)
                else:
                    raise Refused(f"the checkpoint holds {name}, which its variant "
                                  f"({self.config.affine_attention['variant']!r}) does not use; its config.json "
                                  "does not match its weights")

        loaded |= set(super().load_weights(originals()))
        missing = sorted(n for n in (*mine, *buffers) if f".{layers.VARIANT_ATTR}." in n and n not in loaded
                         and not n.endswith(".alpha_acc"))
        if missing:
            raise Refused(f"the checkpoint lacks {len(missing)} weight(s) of its attention variant, e.g. {missing[:3]}")
        if ranks > 1:
            _check_split(self, whole, ranks, rank)
        for module in self.modules():
            if isinstance(module, VariantAttention):
                module.refresh_sinks()
        return loaded


def _rank_rows(name: str, tensor: Tensor, target: Tensor, ranks: int, rank: int) -> Tensor:
    """The part of checkpoint tensor `name` that this rank's variant holds. vLLM gives rank r the query heads
    r * Hq / P .. (r + 1) * Hq / P (whole KV groups); a variant tensor whose first dimension scales with the head
    count (alpha_proj, gate_proj rows; sinks, alpha_ma, output_scale entries) is cut there, head-major (checked
    against the whole variant by `_check_split`); one of the same shape on every rank is copied whole."""
    if tuple(tensor.shape) == tuple(target.shape):
        return tensor
    rows = target.shape[0] if target.dim() else 0
    if ranks > 1 and target.dim() and tensor.shape[0] == ranks * rows and tensor.shape[1:] == target.shape[1:]:
        return tensor[rank * rows:(rank + 1) * rows]
    raise Refused(f"the checkpoint's {name} has shape {tuple(tensor.shape)}; this rank ({rank} of {ranks}) holds "
                  f"{tuple(target.shape)}, which is not its part of the heads")


def _check_split(model: nn.Module, whole: dict[str, Tensor], ranks: int, rank: int) -> None:
    """Under tensor parallelism: each layer's variant on this rank must compute exactly its heads' part of what the
    whole variant (every head, the checkpoint's tensors) computes, on one random input; else the split is wrong for
    this variant's layout and serving would be silently wrong."""
    x = torch.randn(1, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for prefix, module in model.named_modules():
        if not isinstance(module, VariantAttention):
            continue
        local = module.variant_ref[0]
        floats = [t for t in (*local.parameters(), *local.buffers()) if t.is_floating_point()]
        if not floats:  # no weights: nothing was split
            continue
        attn_prefix = prefix.rsplit(".", 1)[0] + f".{layers.VARIANT_ATTR}."
        s = local.shape
        full = type(local)(AttentionShape(s.hidden_size, s.num_heads * ranks, s.num_kv_heads * ranks, s.head_dim),
                           local.options).to(device=floats[0].device, dtype=floats[0].dtype).eval()
        full.load_state_dict({k[len(attn_prefix):]: v for k, v in whole.items() if k.startswith(attn_prefix)},
                             strict=False)
        xs = x.to(device=floats[0].device, dtype=floats[0].dtype)
        with torch.no_grad():
            want, got = full.prologue(xs, None), local.prologue(xs, None)
        for field, a, b in zip(Prologue._fields, want, got):
            ok = a == b if not isinstance(a, Tensor) else _is_part(a, b, rank)
            if not ok:
                raise Refused(f"{prefix}: rank {rank} of {ranks} does not compute its heads' part of the variant's "
                              f"{field!r}: variant {local.name!r} lays out its per-head weights in a way this "
                              "plugin's tensor-parallel split does not follow; serve it with tensor_parallel_size=1")


def _is_part(whole: Tensor, part: Tensor, rank: int) -> bool:
    """Whether `part` is rank `rank`'s slice of `whole` along the one dimension whose size differs (the heads), to
    the rounding of the dtype (a GEMM of fewer rows may sum in another order)."""
    dim = next((d for d in range(whole.dim()) if whole.shape[d] != part.shape[d]), None)
    want = whole if dim is None else whole.narrow(dim, rank * part.shape[dim], part.shape[dim])
    try:
        torch.testing.assert_close(part, want)
    except AssertionError:
        return False
    return True


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

