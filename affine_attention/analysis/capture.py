"""Capture the paper's attention diagnostics from a converted causal LM with forward hooks, chunk by chunk.

Every `AttentionVariant` module in the model (``self_attn.attn_variant`` after `affine_attention.convert`) gets a
forward hook; the hook recomputes the layer's weights with `variant.reference` for one block of queries at a time
and reduces them at once into per-head running statistics, so memory holds one layer's (B, H, chunk, S) block.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import Tensor, nn

from ..ops.call import AttentionCall
from ..ops.logits import visible_logit_sums
from ..variants import REFERENCE, AttentionVariant
from ..variants.base import ForwardArgs
from .layer_stats import LayerStats
from .mass_metrics import head_utilisation
from .scale_metrics import alpha_distribution

__all__ = ["AttentionRecorder", "LayerRecord", "find_variant_modules", "utilisation", "DEFAULT_HIST_EDGES"]

# Per-query total mass of softmax/sink rows lies in [0, 1]; affine rows (alpha p + beta) can leave it slightly,
# so the accumulated histogram is a little wider than [0, 1] (values further out fall into the end bins).
DEFAULT_HIST_EDGES = torch.linspace(-0.25, 1.25, 61, dtype=torch.float64)


def find_variant_modules(model: nn.Module) -> list[tuple[int, str, AttentionVariant]]:
    """(layer index, module name, variant) for every attention-variant module, in layer order.

    The layer index is the first integer in the module's dotted name (``model.layers.7.self_attn.attn_variant`` ->
    7); names without one are numbered by their order in the model.
    """
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, AttentionVariant)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no attention-variant modules to record; convert it first, e.g. "
            f"`affine_attention.convert(model, {REFERENCE!r})` ({REFERENCE} leaves the model's logits unchanged)")
    out = []
    for order, (name, m) in enumerate(found):
        num = next((int(p) for p in name.split(".") if p.isdigit()), None)
        out.append((num if num is not None else order, name, m))
    if len({i for i, _, _ in out}) != len(out):  # e.g. an encoder-decoder: fall back to plain order
        out = [(order, name, m) for order, (_, name, m) in enumerate(out)]
    return sorted(out, key=lambda t: t[0])


@dataclass
class LayerRecord:
    """Everything captured for one attention layer. Per-head tensors are float64 CPU, shape (H,).

    stats: `layer_stats.LayerStats.result()` (first_token_mass, entropy, mean_total_mass,
      mean_total_mass_sink_excluded, hist_counts (H, n), hist_edges (n+1,), n_queries).
    attention_map: (m, m) head- and batch-averaged weights of the first m queries x m keys (m = map_size).
    qk_logit_mean, qk_logit_abs_mean: mean of q.k*scale and of its absolute value over visible keys of real queries.
    alpha: `scale_metrics.alpha_distribution` of alpha over real queries (affine variants), else None.
    sink_mass: mean learned-sink mass per head (sink variants), else None.
    total_mass_values: (n,) float32 per-query total mass (first token excluded) of real queries, all heads pooled;
      None when the recorder was built with keep_values=False.
    """

    index: int
    name: str
    variant: str
    num_heads: int
    stats: dict
    attention_map: Tensor
    qk_logit_mean: Tensor
    qk_logit_abs_mean: Tensor
    alpha: dict | None = None
    sink_mass: Tensor | None = None
    total_mass_values: Tensor | None = None

    def layer_mean(self, key: str) -> float:
        """Mean over heads of a per-head stat (all heads see the same queries, so also the mean over queries)."""
        v = self.stats[key] if key in self.stats else getattr(self, key)
        return float(torch.nanmean(v.to(torch.float64)))


@dataclass
class _Accumulator:
    """Running sums for one layer (all CPU float64; O(H + m^2) memory plus optional per-query values)."""

    stats: LayerStats
    map_size: int
    map_sum: Tensor | None = None
    map_count: Tensor | None = None
    qk: Tensor | None = None  # (3, H): sum, sum of |x|, count
    sink: Tensor | None = None  # (2, H): sum, count
    alpha_values: list = field(default_factory=list)  # (H, n_chunk) float32 pieces
    totals: list = field(default_factory=list)
    variant: str = ""
    num_heads: int = 0


def _add(acc: Tensor | None, x: Tensor) -> Tensor:
    return x if acc is None else acc + x


class AttentionRecorder:
    """Context manager that records attention statistics of every (or selected) layer during forwards.

        with AttentionRecorder(model, chunk=256) as rec:
            model(input_ids=ids, attention_mask=am, use_cache=False)
        layers = rec.results()  # list[LayerRecord] in layer order

    Several forwards accumulate (one per batch of sequences). Padding: real queries come from the variant's
    ``token_mask`` argument when the model passes one, else from the ``attention_mask`` given to the recorded
    model's forward (2-D (B, T), 1 = real token), else from a (B, 1, 1, S) key mask when T == S; padded queries
    enter no statistic. Rows of the attention map are absolute query positions, so pad on the right.
    The recorder never changes the model's outputs or state (reference ops do not update alpha_ma); run the
    forward without a KV cache (use_cache=False) so each layer sees the whole sequence.

    chunk: queries per block (the memory knob: one block is (B, H, chunk, <=S) weights). layers: optional layer
    indices to record (default all). map_size: side of the attention map. keep_values: keep per-query total masses
    and alpha values (O(B * H * T) floats per layer, for histograms and quantiles).
    """

    def __init__(self, model: nn.Module, *, chunk: int = 256, layers: Iterable[int] | None = None,
                 map_size: int = 30, hist_edges: Tensor | int | None = None, keep_values: bool = True):
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"chunk must be a positive int (queries per block), got {chunk!r}")
        if not isinstance(map_size, int) or map_size < 1:
            raise ValueError(f"map_size must be a positive int, got {map_size!r}")
        self.model = model
        self.chunk = chunk
        self.map_size = map_size
        self.keep_values = keep_values
        self._hist_edges = DEFAULT_HIST_EDGES if hist_edges is None else hist_edges
        modules = find_variant_modules(model)
        wanted = None if layers is None else set(int(i) for i in layers)
        if wanted is not None:
            missing = wanted - {i for i, _, _ in modules}
            if missing:
                raise ValueError(f"layers {sorted(missing)} not found; the model has layers "
                                 f"{[i for i, _, _ in modules]}")
            modules = [t for t in modules if t[0] in wanted]
        self._modules = modules
        self._handles: list = []
        self._model_mask: Tensor | None = None
        self.reset()

    # --- context manager ------------------------------------------------------------------------
    def __enter__(self) -> "AttentionRecorder":
        if self._handles:
            raise RuntimeError("AttentionRecorder is already active")
        self._handles.append(self.model.register_forward_pre_hook(self._model_pre_hook, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._model_post_hook, with_kwargs=True))
        for index, name, m in self._modules:
            self._handles.append(m.register_forward_hook(self._layer_hook(index), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._model_mask = None

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self._acc = {index: _Accumulator(LayerStats(hist_edges=self._hist_edges), self.map_size)
                     for index, _, _ in self._modules}

    # --- hooks ----------------------------------------------------------------------------------
    def _model_pre_hook(self, module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is None and args:
            try:
                mask = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments.get("attention_mask")
            except TypeError:
                mask = None
        self._model_mask = mask.bool() if isinstance(mask, Tensor) and mask.dim() == 2 else None

    def _model_post_hook(self, module, args, kwargs, output):
        self._model_mask = None

    def _layer_hook(self, index: int):
        def hook(module: AttentionVariant, args, kwargs, output):
            with torch.no_grad():
                self._record(index, module, ForwardArgs.of(args, kwargs))
        return hook

    def _query_mask(self, fa: ForwardArgs) -> Tensor | None:
        """(B, T) bool of real queries, or None when every query is real (see the class docstring)."""
        B, _, T, _ = fa.call.q.shape
        m = self._model_mask
        if fa.token_mask is None and m is not None and tuple(m.shape) == (B, T):
            return m
        return fa.real_queries()

    # --- the chunked reduction ----------------------------------------------------------------
    def _record(self, index: int, module: AttentionVariant, fa: ForwardArgs) -> None:
        """fa: the layer's forward arguments; its call's q: (B, Hq, T, D), k, v: (B, Hkv, S, D), mask (the very
        MaskSpec the layer's fast path used: causal, padding, window, documents, dense alike) and score (scale and
        the model's softcap), x: (B, T, hidden); one block of queries at a time."""
        acc = self._acc[index]
        call, x = fa.call, fa.x
        q, k, v, mask = call.q, call.k, call.v, call.mask
        B, H, T, _ = q.shape
        S = k.shape[2]
        acc.variant, acc.num_heads = module.name, H
        qmask = self._query_mask(fa)
        if qmask is not None:
            qmask = qmask.to(q.device)
        for t0 in range(0, T, self.chunk):
            t1 = min(T, t0 + self.chunk)
            # The block's queries see no key past `hi` (causal, from the shapes): passing only keys [0, hi) costs a
            # triangle, and keeps key positions absolute (first-token statistics read key 0).
            hi = mask.static_key_range(t0, t1)[1]
            hi = hi if hi >= 1 else S  # T > S: these queries see no key; the block mask says so
            vis = mask.chunk_bool(t0, t1, q.device, 0, hi)  # (B|1, 1|H, Tc, hi): the whole mask of this block
            qb, kb, vb, xb = q[:, :, t0:t1], k[:, :, :hi], v[:, :, :hi], x[:, t0:t1]
            qm = qmask[:, t0:t1] if qmask is not None else None
            qs = call.score.q_scale
            score = call.score if qs is None else call.score._replace(q_scale=qs[:, :, t0:t1])
            block = AttentionCall.of(qb, kb, vb, attn_mask=vis, score=score)
            _, w, extras = module.reference_of(block, xb, fa.model_sinks)
            self._reduce(acc, w, vis, qm, extras, t0)
            acc.qk = _add(acc.qk, visible_logit_sums(qb, kb, vis, score, query_mask=qm))
            del w, extras, vis

    def _reduce(self, acc: _Accumulator, w: Tensor, vis: Tensor, qm: Tensor | None, extras: dict, t0: int) -> None:
        """w: (B, H, Tc, Sc); vis: (B|1, 1|H, Tc, Sc) bool; qm: (B, Tc) bool or None."""
        B, H, Tc, Sc = w.shape
        if w.dtype not in (torch.float32, torch.float64):  # bf16/fp16 models: reduce in float32
            w = w.float()
        sink = extras.get("sink_mass")
        acc.stats.update(w, vis, qm, sink_mass=sink)
        qm_full = qm if qm is not None else torch.ones(B, Tc, dtype=torch.bool, device=w.device)
        visx = vis.expand(B, H, Tc, Sc)
        real = visx.any(-1) & qm_full[:, None, :]  # (B, H, Tc): the real queries of attention_rows.py
        if sink is not None:
            s = torch.where(real, sink, torch.zeros_like(sink)).double()
            acc.sink = _add(acc.sink, torch.stack([s.sum((0, 2)), real.sum((0, 2)).double()]).cpu())
        if "alpha" in extras and self.keep_values:
            a = extras["alpha"].detach().permute(1, 0, 2)[:, qm_full]  # (H, n_real)
            acc.alpha_values.append(a.to("cpu", torch.float32))
        if self.keep_values:
            # mass_metrics.total_mass: visible weight minus the first visible key's (argmax finds the first True)
            first = visx.byte().argmax(-1, keepdim=True)
            total = torch.where(visx, w, 0.0).sum(-1) - w.gather(-1, first).squeeze(-1)
            acc.totals.append(total[real].to("cpu", torch.float32))  # `real` rows see at least one key
        m = self.map_size
        if t0 < m:  # rows of the absolute attention map live in the first blocks only
            r = min(m, t0 + Tc) - t0
            sub = torch.zeros(B, H, r, m, dtype=torch.float64, device=w.device)
            c = min(m, Sc)
            sub[..., :c] = torch.where(visx[:, :, :r, :c], w[:, :, :r, :c], 0).double()
            rows = qm_full[:, :r].double()  # (B, r)
            summed = (sub.sum(1) * rows[:, :, None]).sum(0).cpu()  # (r, m)
            count = (rows.sum(0) * H).cpu()  # (r,)
            if acc.map_sum is None:
                acc.map_sum = torch.zeros(m, m, dtype=torch.float64)
                acc.map_count = torch.zeros(m, dtype=torch.float64)
            acc.map_sum[t0:t0 + r] += summed
            acc.map_count[t0:t0 + r] += count

    # --- results --------------------------------------------------------------------------------
    def results(self) -> list[LayerRecord]:
        """One `LayerRecord` per recorded layer, in layer order; RuntimeError if nothing was recorded."""
        out = []
        for index, name, _ in self._modules:
            acc = self._acc[index]
            if acc.qk is None:
                raise RuntimeError(f"layer {index} ({name}) recorded nothing: run a forward inside the "
                                   "`with AttentionRecorder(...)` block first")
            nan = torch.full((acc.num_heads,), float("nan"), dtype=torch.float64)
            cnt = acc.qk[2]
            qk_mean = torch.where(cnt > 0, acc.qk[0] / cnt.clamp(min=1), nan)
            qk_abs = torch.where(cnt > 0, acc.qk[1] / cnt.clamp(min=1), nan)
            n = acc.map_count.clamp(min=1)[:, None]
            amap = torch.where(acc.map_count[:, None] > 0, acc.map_sum / n, torch.zeros_like(acc.map_sum))
            seen = int((acc.map_count > 0).sum())  # sequences shorter than map_size leave the last rows empty
            amap = amap[:seen, :seen] if seen else amap[:0, :0]
            alpha = None
            if acc.alpha_values:
                a = torch.cat(acc.alpha_values, dim=1)  # (H, n_real)
                alpha = alpha_distribution(a[None].double())  # as one (1, H, n) batch of real queries
            sink = None
            if acc.sink is not None:
                sink = torch.where(acc.sink[1] > 0, acc.sink[0] / acc.sink[1].clamp(min=1), nan)
            totals = torch.cat(acc.totals) if acc.totals else None
            out.append(LayerRecord(index, name, acc.variant, acc.num_heads, acc.stats.result(), amap, qk_mean,
                                   qk_abs, alpha, sink, totals))
        return out


def utilisation(records: list[LayerRecord], sink_excluded: bool = True) -> Tensor:
    """(L, H) layer x head grid of mean total mass, min-max normalised to [0, 1] (`mass_metrics.head_utilisation`)."""
    key = "mean_total_mass_sink_excluded" if sink_excluded else "mean_total_mass"
    return head_utilisation([r.stats[key] for r in records])
