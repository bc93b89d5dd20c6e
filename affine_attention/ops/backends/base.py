"""The contract every softmax kernel backend follows, and the registry a backend joins with `@register`.

A backend computes plain softmax attention for a MaskSpec and returns (out, lse). Backends with a log-sum-exp
implement `forward`/`backward` as raw (non-autograd) functions, which the dispatcher (backends/__init__.py) wraps
once with the sink; backends without an lse (SDPA) are differentiable by themselves and serve only calls that need
no lse. One file in this folder = one backend; its declared `priority` orders the automatic choice.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..call import Score
from ..masks import MaskSpec


class Call(NamedTuple):
    """What a backend is asked to do; `Backend.supports` reads only this (shapes, dtype, device, mask kinds).

    q: (B, Hq, T, D), k/v: (B, Hkv, S, D). needs_lse: the caller wants the log-sum-exp (sinks) or, equivalently,
    the raw forward/backward pair. score: how logits are made (its q_scale already folded into q by the caller).
    A NamedTuple: it is built on every op call, and cheap to build.
    """

    device_type: str
    dtype: torch.dtype
    B: int
    Hq: int
    Hkv: int
    T: int
    S: int
    D: int
    mask: MaskSpec
    needs_lse: bool
    requires_grad: bool
    score: Score | None = None  # None: plain logits (q.k scale, no score function)

    @staticmethod
    def of(q: Tensor, k: Tensor, mask: MaskSpec, needs_lse: bool, score: Score | None = None) -> "Call":
        B, Hq, T, D = q.shape
        return Call(q.device.type, q.dtype, B, Hq, k.shape[1], T, k.shape[2], D, mask, needs_lse,
                    torch.is_grad_enabled() and (q.requires_grad or k.requires_grad), score)


class Backend:
    """One softmax kernel. Subclasses set `name` and `priority` (higher is tried first), implement `supports`, and
    either `attention` (differentiable, no lse) or the raw pair `forward`/`backward` (has_lse = True).

    Layouts: q (B, Hq, T, D); k, v (B, Hkv, S, D); out (B, Hq, T, D) in q.dtype; lse (B, Hq, T) float32 (float64
    for float64 inputs), -inf for a query that sees no key (whose out is 0). GQA is native (Hq a multiple of Hkv).
    """

    name: str = ""
    priority: int = 0
    has_lse: bool = True
    #: The score functions (`Score.kind`: "softcap", "score_fn") this kernel applies to its logits; the dispatcher
    #: never hands a call whose score has another to it, since softmax of the unchanged logits would be silently
    #: wrong. Every kernel reads `score.scale`; `score.q_scale` never reaches one (folded into q).
    score: frozenset[str] = frozenset()
    #: The memory layouts the kernel reads correctly. "any": every strided view (eager ops, or torch's SDPA, which
    #: fixes layouts itself). "last_dim_contiguous": the head dimension D must have stride 1 (aten's flash kernels
    #: read D as a dense vector and, given a transposed or D-expanded view, read memory that is not the input).
    layout: str = "any"
    #: Whether `attention(..., with_lse=True)` also returns the log-sum-exp, differentiable like the output (flex):
    #: the dispatcher then builds the sink as plain autograd on it, with no raw pair and no KernelAttention.
    differentiable_lse: bool = False

    def accepts_layout(self, t: Tensor) -> bool:
        """Whether this kernel reads t: (B, H, T|S, D) correctly as it is laid out in memory."""
        if self.layout == "any":
            return True
        return t.shape[-1] <= 1 or t.stride(-1) == 1

    def supports(self, call: Call) -> str | None:
        """None if this backend computes `call` exactly; otherwise a short reason naming what it lacks."""
        raise NotImplementedError

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, score: Score) -> Tensor:
        """Differentiable softmax attention (backends without a raw pair). A backend with `differentiable_lse` takes
        `with_lse=` and returns (out, lse (B, Hq, T) float32, or None when not asked)."""
        raise NotImplementedError(f"backend {self.name!r} has no differentiable attention()")

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, score: Score) -> tuple[Tensor, Tensor]:
        """Raw forward (no autograd): (out, lse)."""
        raise NotImplementedError(f"backend {self.name!r} has no raw forward()")

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: MaskSpec,
                 score: Score) -> tuple[Tensor, Tensor, Tensor]:
        """Raw backward of softmax attention: (dq, dk, dv) given dout and the forward's out and lse.

        Uses the row term D_i = sum_d dout_id * out_id; the sink trick relies on exactly that (see KernelAttention).
        """
        raise NotImplementedError(f"backend {self.name!r} has no raw backward()")


#: Every registered backend, highest priority first: the order in which the automatic choice asks them.
REGISTRY: list[Backend] = []


def register(cls: type[Backend]) -> type[Backend]:
    """Class decorator: add one instance of a backend to REGISTRY at its priority. A second backend with the same
    name or the same priority is a programming error (the order between them would be arbitrary)."""
    for b in REGISTRY:
        if b.name == cls.name or b.priority == cls.priority:
            raise ValueError(f"backend {cls.name!r} (priority {cls.priority}) clashes with the registered "
                             f"{b.name!r} (priority {b.priority}): names and priorities must be unique")
    REGISTRY.append(cls())
    REGISTRY.sort(key=lambda b: -b.priority)
    return cls
