"""Softmax kernel backends behind every op, and the dispatcher that picks the first one that accepts a call.

Order matters: the first backend in BACKENDS whose `supports` returns None serves the call. `backend="name"` on
the public ops, or `with use_backend("name"):`, forces one; a forced backend that cannot serve a call raises a
ValueError naming what it lacks, never falling back.
"""
from __future__ import annotations


import torch
from torch import Tensor

from .._forcing import ForcedChoice
from ..masks import MaskSpec
from .base import Backend, Call, KernelAttention, with_sink
from .cpu_flash import CpuFlashBackend
from .cuda_flash import CudaFlashBackend
from .exact import ExactBackend
from .sdpa import SdpaBackend

# Preference order: fastest first, the exact fallback (any mask, device and dtype) last.
BACKENDS: list[Backend] = [SdpaBackend(), CudaFlashBackend(), CpuFlashBackend(), ExactBackend()]



def backend_names() -> list[str]:
    return [b.name for b in BACKENDS]


def get_backend(name: str) -> Backend:
    for b in BACKENDS:
        if b.name == name:
            return b
    raise ValueError(f"unknown attention backend {name!r}; choose one of {backend_names()}")


_forced = ForcedChoice(get_backend)


def use_backend(name: str | None):
    """Force every attention op in this block (this thread) onto backend `name` (None: automatic choice)."""
    return _forced.use(name)


def forced_name() -> str | None:
    """The backend `use_backend` forces in this thread, or None."""
    return _forced.current


def select(call: Call, backend: str | None = None) -> Backend:
    """The backend that serves `call`: the forced one (ValueError if it cannot), else the first that accepts."""
    name = backend if backend is not None else _forced.current
    if name is not None:
        chosen = get_backend(name)
        reason = chosen.supports(call)
        if reason is not None:
            raise ValueError(f"attention backend {name!r} cannot serve this call: {reason}; drop backend= "
                             f"(automatic choice) or pick another of {backend_names()}")
        return chosen
    reasons = []
    for b in BACKENDS:
        reason = b.supports(call)
        if reason is None:
            return b
        reasons.append(f"{b.name}: {reason}")
    raise ValueError("no attention backend can serve this call (" + "; ".join(reasons) + ")")


def attention(q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, scale: float, *, sinks: Tensor | None = None,
              backend: str | None = None) -> tuple[Tensor, Tensor | None]:
    """Softmax attention (with the sink's extra exp(sinks[h]) in the denominator when sinks is given).

    q: (B, Hq, T, D); k, v: (B, Hkv, S, D); sinks: (Hq,) or None. Returns (out (B, Hq, T, D) in q.dtype,
    lse (B, Hq, T) float32 of the plain softmax, or None when the chosen backend has none).
    """
    return attention_on(select(Call.of(q, k, mask, needs_lse=sinks is not None), backend), q, k, v, mask, scale,
                        sinks=sinks)


def attention_on(chosen: Backend, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, scale: float, *,
                 sinks: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """`attention` on a backend already chosen for this call (see ops/plan.py); layouts as `attention`."""
    if not chosen.has_lse:
        return chosen.attention(q, k, v, mask, scale), None
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
        # Nothing to differentiate (decoding): the raw forward, without an autograd node (a few µs per layer).
        out, lse = chosen.forward(q, k, v, mask, scale)
        return with_sink(out, lse, sinks)[0], lse
    return KernelAttention.apply(chosen, q, k, v, sinks, mask, scale)


__all__ = ["BACKENDS", "Backend", "Call", "KernelAttention", "attention", "attention_on", "backend_names",
           "forced_name", "get_backend", "select", "use_backend"]
