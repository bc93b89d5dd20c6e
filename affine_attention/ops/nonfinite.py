"""The non-finite guarantee of the fast path, in as few passes as it can hold: a non-finite key or value row reaches
only the queries that may see it (they get nan, as the float64 reference's arithmetic gives), and a query whose q row
or alpha is non-finite gets nan whatever the kernel's running max made of it.

Kernels multiply hidden values by a zero weight and add a -inf bias to hidden logits; 0 * nan, nan - inf and
inf - inf are nan, so without this a padded or future key poisons rows that never see it. Where asking the data
would sync (CUDA, compiled graphs) every row is tested: on CUDA (impl "triton") in two fused passes
(nonfinite_triton.py: one over k and v writing the copies and the row flags, one over the output testing q and
alpha); elsewhere with the torch ops below, the readable form and the CPU/meta path (a row reduction over each of q,
k and v, a masked copy of k and v, a masked pass over the output). Eager CPU asks first and, in the common all-finite
case, does none of the copies (benchmarks/bench_isolation.py measures both paths against raw SDPA).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .masks import MaskSpec
from .visible_sums import visible_sum_and_count

# A padded key hides from every query, so its content never matters, but the additive -inf bias some kernels apply
# to it is only safe while its logit is finite: once |q|max * |k|max * D * scale may pass float32's range (this
# bound, a factor 16 below it), padded rows are zeroed too.
_LOGIT_ROOM = torch.finfo(torch.float32).max / 16


def _asks(t: Tensor) -> bool:
    """Whether reading a value of `t` on the host is cheap and allowed: eager CPU (no sync, no graph break)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _finite_rows(x: Tensor) -> Tensor:
    """x: (..., D) -> (...) bool, True where the row holds no nan or inf. One reduction without a full-size bool
    intermediate: aminmax propagates nan, and an inf is its own min or max."""
    lo, hi = torch.aminmax(x.detach(), dim=-1)
    return torch.isfinite(lo) & torch.isfinite(hi)


def _fused(impl: str | None):
    """The fused kernels' operators where impl is "triton" (chosen and checked by epilogue.select_impl), else None."""
    if impl != "triton":
        return None
    from .nonfinite_triton import OPS
    return OPS


def isolate(q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, scale: float,
            known: Tensor | bool | None = None, impl: str | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """q: (B, Hq, T, D); k, v: (B, Hkv, S, D) -> (k, v with every non-finite key row and value row set to 0, seen),
    seen: (B, Hkv|Hq, T|1, 1) bool, True for the queries that may see such a row (None when there is none).
    known: (B, Hkv) bool, the heads that hold such a row, or False for none, when the caller knows (a decoding
    cache): then no row is read where that decides. Padded keys (hidden from every query) are zeroed with them
    where their logits could overflow (eager CPU) or always (elsewhere: the same masked copy, no extra pass).
    impl: "triton" runs the tests and copies as one fused pass (nonfinite_triton.py), else torch ops."""
    Hq, D = q.shape[1], q.shape[-1]
    if known is False:
        return k, v, None
    if known is not None and not mask.kinds:
        return k, v, known[:, :, None, None]
    keys = mask.keys
    if _asks(k):
        kabs = float(torch.stack(torch.aminmax(k.detach())).double().abs().max())
        vsum = float(v.detach().sum())
        # q's magnitude matters only for padded keys' logits; without padding `poison` reads q once, not twice.
        qabs = (float(torch.stack(torch.aminmax(q.detach())).double().abs().max())
                if keys is not None and math.isfinite(kabs) else 0.0)
        if math.isfinite(kabs) and math.isfinite(vsum) and (
                keys is None or kabs * qabs * D * abs(scale) < _LOGIT_ROOM):
            return k, v, None  # the common case: one reduction per tensor, no copy
    fused = _fused(impl)
    if not mask.kinds:
        # Every query sees every key: each query of a head with a non-finite row is nan. Without this a key whose
        # logit is -inf would drop out of the softmax and leave the output finite.
        bad = fused.nonfinite_rows(k, v) if fused else ~(_finite_rows(k) & _finite_rows(v))  # (B, Hkv, S)
        if _asks(k) and not bool(bad.any()):
            return k, v, None
        return k, v, bad.any(-1)[:, :, None, None]
    if fused:
        k, v, bad = fused.isolate(k, v, keys)
    else:
        bad = ~(_finite_rows(k) & _finite_rows(v))
        row = bad[..., None] if keys is None else bad[..., None] | ~keys.reshape(keys.shape[0], 1, -1, 1)
        k, v = k.masked_fill(row, 0), v.masked_fill(row, 0)
    seen, _ = visible_sum_and_count(bad[..., None].to(v.dtype), mask, Hq)  # a padded row is never visible
    return k, v, seen > 0.5


def poison(out: Tensor, seen: Tensor | None, q: Tensor, alpha: Tensor | None, impl: str | None = None) -> Tensor:
    """out: (B, Hq, T, D); seen from `isolate`; q: (B, Hq, T, D); alpha: (B, Hq, T) or None -> out with nan in
    every query that saw a non-finite key or value, or whose q row or alpha is non-finite, in one masked pass.
    Fast kernels otherwise return a finite row there (their running max skips a nan logit, and -inf logits read as
    "sees no key" give 0); the rule is one for every backend. impl: "triton" runs it as one fused pass that also
    tests q and alpha (nonfinite_triton.py), else torch ops."""
    if seen is None and _asks(q) and math.isfinite(float(q.detach().sum() + (0 if alpha is None
                                                                              else alpha.detach().sum()))):
        return out  # the common case: one reduction per tensor, no pass over the output
    fused = _fused(impl)
    if fused:
        return fused.poison(out, q, alpha, seen)
    B, Hq, T, D = out.shape
    hit = ~_finite_rows(q)  # (B, Hq, T)
    if alpha is not None:
        hit = hit | ~torch.isfinite(alpha.detach())
    if seen is not None:
        G = Hq // seen.shape[1]
        hit = hit | seen[:, :, None, :, 0].expand(B, Hq // G, G, seen.shape[2]).reshape(B, Hq, seen.shape[2])
    return out.masked_fill(hit[..., None], float("nan"))
