"""The attention-sink mechanism on the Bigram-Backcopy task (train/data_backcopy.py): one model, one batch of task
sequences, split by what each query has to do.

Active queries are trigger tokens (the next token copies the previous one: the head must attend to it); dormant
queries are every other token after BOS (the bigram needs no attention: softmax must still put its unit mass
somewhere, and a sink parks it on BOS). Per attention layer, each measured on active and on dormant queries:
  p_first            first-token (BOS) weight of the plain softmax over the visible keys (the variant's kernel part)
  w_first            first-token weight of the variant's effective weights (affine: alpha p + beta; sink: the mass
                     left to real tokens; softmax: p), which is what reaches the output: the two can disagree, so a
                     claim must say which one it tests
  alpha              the affine scale (mean and quartiles), where the variant has one
  sink_share         the sink variant's mass on its learned logit, where it has one
and per layer: the value-state norm of BOS over the mean of the other tokens' (value drain: < 1 means BOS carries a
small value, so attention parked on it changes little), the residual-state norm of BOS over the others' (the
residual peak) and, for the model, backcopy accuracy on active queries, cross-entropy on dormant (bigram) queries
and the lowest cross-entropy the chain allows there (its entropy). Names of variants are never used: alpha and the
sink share come from the variant's reference extras when it has them.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._numbers import mean_std
from ..ops import softmax_attention_reference
from ..variants.base import ForwardArgs
from .capture import find_variant_modules

__all__ = ["measure", "sink_formed", "aggregate", "SINK_FACTOR"]

# The probe's sink criterion (the issue's): the dormant queries' first-token softmax mass in the probe's layer is at
# least SINK_FACTOR x the uniform share (mean of 1 / N_i over the same queries).
SINK_FACTOR = 3.0


def _mean_on(x: Tensor, sel: Tensor) -> float | None:
    """Mean of x (B, H, T) over heads and the selected queries sel (B, T); None when none is selected."""
    if not bool(sel.any()):
        return None
    return float(x.permute(1, 0, 2)[:, sel].double().mean())


def _quartiles(x: Tensor, sel: Tensor) -> dict | None:
    if not bool(sel.any()):
        return None
    v = x.permute(1, 0, 2)[:, sel].double().flatten()
    q = torch.quantile(v, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    return {"mean": float(v.mean()), "q25": float(q[0]), "median": float(q[1]), "q75": float(q[2])}


def _layer(module, args, kwargs, active: Tensor, dormant: Tensor) -> dict[str, Any]:
    fa = ForwardArgs.of(args, kwargs)
    call = fa.call
    q, k, v, mask = call.q, call.k, call.v, call.mask
    B, H, T, D = q.shape
    S = k.shape[2]
    vis = mask.chunk_bool(0, T, q.device, 0, S)  # (B|1, 1|H, T, S)
    _, w, extras = module.reference_of(call, fa.x, fa.model_sinks)
    # the plain softmax over the visible keys (the variant's kernel part, the model's own score), in float64
    _, p = softmax_attention_reference(q.double(), k.double(), v.double(), mask=mask, score=call.score,
                                       enable_gqa=H != k.shape[1])
    vnorm = v.double().norm(dim=-1)  # (B, Hkv, S)
    uniform = (1.0 / vis.sum(-1).clamp(min=1)).expand(B, H, T).double()  # 1 / N_i
    out = {"p_first": {"active": _mean_on(p[..., 0], active), "dormant": _mean_on(p[..., 0], dormant)},
           "w_first": {"active": _mean_on(w[..., 0], active), "dormant": _mean_on(w[..., 0], dormant)},
           "value_norm_ratio": float(vnorm[..., 0].mean() / vnorm[..., 1:].mean()),
           "uniform_first": {"active": _mean_on(uniform, active), "dormant": _mean_on(uniform, dormant)}}
    if "alpha" in extras:
        out["alpha"] = {"active": _quartiles(extras["alpha"], active), "dormant": _quartiles(extras["alpha"], dormant)}
    if extras.get("sink_mass") is not None:
        s = extras["sink_mass"]
        out["sink_share"] = {"active": _mean_on(s, active), "dormant": _mean_on(s, dormant)}
    return out


@torch.no_grad()
def measure(model, ids: Tensor, task) -> dict[str, Any]:
    """The module docstring's measurements of a converted causal LM on task sequences ids (B, T + 1) int64 (inputs
    ids[:, :-1], next tokens ids[:, 1:]); `task` is the `BackcopyTask` that drew them."""
    inputs, targets = ids[:, :-1], ids[:, 1:]
    active = task.trigger_mask(inputs)
    dormant = ~active
    dormant[:, 0] = False  # BOS itself sees only itself: its weight on BOS is 1 whatever the head does
    found = find_variant_modules(model)
    layers: dict[int, dict] = {}
    residual: dict[int, float] = {}
    handles = []
    for index, name, m in found:
        handles.append(m.register_forward_hook(
            lambda mod, args, kwargs, out, i=index: layers.__setitem__(i, _layer(mod, args, kwargs, active, dormant)),
            with_kwargs=True))
        block = model.get_submodule(name.split(".self_attn")[0]) if ".self_attn" in name else None
        if block is not None:  # the decoder layer's output is the residual stream after this layer
            def res_hook(mod, args, out, i=index):
                h = (out[0] if isinstance(out, tuple) else out).double().norm(dim=-1)  # (B, T)
                residual[i] = float(h[:, 0].mean() / h[:, 1:].mean())
            handles.append(block.register_forward_hook(res_hook))
    try:
        logits = model(input_ids=inputs, use_cache=False).logits.double()
    finally:
        for h in handles:
            h.remove()
    ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, T)
    acc = (logits.argmax(-1) == targets).double()
    per_layer = [{"layer": i, **layers[i], "residual_norm_ratio": residual.get(i)} for i in sorted(layers)]
    return {"layers": per_layer,
            "backcopy_accuracy": float(acc[active].mean()) if bool(active.any()) else None,
            "bigram_loss": float(ce[dormant].mean()),
            "bigram_entropy": float(task.bigram_entropy(inputs)[dormant].mean()),
            "max_residual_norm_ratio": max((r for r in residual.values()), default=None),
            "active_fraction": float(active[:, 1:].double().mean())}


def sink_formed(m: dict[str, Any], factor: float = SINK_FACTOR) -> bool:
    """Whether some layer's dormant queries put at least `factor` x their uniform share of softmax mass on BOS."""
    return any(L["p_first"]["dormant"] is not None and L["p_first"]["dormant"] >= factor * L["uniform_first"]["dormant"]
               for L in m["layers"])


def _leaves(d: Any, prefix: str = "") -> dict[str, float]:
    if isinstance(d, dict):
        out: dict[str, float] = {}
        for k, v in d.items():
            out.update(_leaves(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: float(d)} if isinstance(d, (int, float)) and not isinstance(d, bool) else {}


def flat(m: dict[str, Any]) -> dict[str, float]:
    """One seed's measurements as flat keys: model-level ones as they are, per-layer ones as "L<i>.<key>..."."""
    out = {k: v for k, v in _leaves({k: v for k, v in m.items() if k != "layers"}).items()}
    for L in m["layers"]:
        out.update({f"L{L['layer']}.{k}": v for k, v in _leaves({k: v for k, v in L.items() if k != "layer"}).items()})
    return out


def aggregate(per_seed: list[dict[str, Any]]) -> dict[str, dict]:
    """Mean, sample std (None with one seed) and the values over seeds of every flat key measured in every seed."""
    flats = [flat(m) for m in per_seed]
    keys = [k for k in flats[0] if all(k in f for f in flats)] if flats else []
    out = {}
    for k in keys:
        vals = [f[k] for f in flats]
        mean, std, _ = mean_std(vals)
        out[k] = {"mean": mean, "std": std, "values": vals}
    return out
