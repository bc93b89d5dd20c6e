"""The variant epilogue: y = g * (a * O + (alpha_ma - a) * m) with a hand-written backward, and m itself.

O is a softmax kernel's output, m the mean of the values each query may see (affine's bias term), a = alpha, g an
output gate or a per-head scale; every part is optional. One autograd.Function serves affine, gated, affine_gated
and scaled_softmax (the sink lives in the kernel, see backends/__init__.py). It saves only tensors other nodes hold
anyway (O, V, alpha, the gate): where m is a prefix sum of V it is recomputed in backward, not saved. On CUDA the
combine runs as one Triton kernel each way, through registered operators (epilogue_triton.py: with m given, the
forward operator and its registered backward, no Function here), elsewhere as a few eager tensor ops (`_eager`, also
the readable form of both). `impl=` or `use_epilogue(...)` forces one; a forced one that cannot run raises.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from ._once import once_differentiable
from .._compat import as_dtype, float_acc
from ._forcing import ForcedChoice
from ._validate import check_per_head, check_per_query, check_v_mean
from .masks import MaskSpec
from .visible_sums import visible_sum_and_count

IMPLS = ("eager", "triton")


def _check_impl_name(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"epilogue impl must be one of {IMPLS} (or None: triton on CUDA, eager elsewhere), "
                         f"got {impl!r}")


_forced = ForcedChoice(_check_impl_name)


def use_epilogue(impl: str | None):
    """Force every epilogue in this block (this thread) onto `impl` ("eager" or "triton"; None: by device)."""
    return _forced.use(impl)


def forced_name() -> str | None:
    """The implementation `use_epilogue` forces in this thread, or None."""
    return _forced.current


def select_impl(device: torch.device, impl: str | None = None) -> str:
    """The implementation that runs on `device`: the forced one, else triton on CUDA and eager elsewhere.

    A forced "triton" off CUDA needs the interpreter (TRITON_INTERPRET=1); a missing triton package raises.
    """
    name = impl if impl is not None else _forced.current
    if name is None:
        name = "triton" if device.type == "cuda" else "eager"
    _check_impl_name(name)
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the triton epilogue runs on CUDA tensors (got {device.type}); on CPU it runs only "
                             "under the interpreter (set TRITON_INTERPRET=1 before importing triton) or pass "
                             "impl='eager'")
        try:
            from . import epilogue_triton  # noqa: F401  (lazy: triton is imported only when used)
        except ImportError as e:
            raise ValueError(f"the triton epilogue needs the `triton` package ({e}); install it or force the "
                             "eager epilogue with impl='eager' / use_epilogue('eager')") from e
    return name


def gate4(gate: Tensor | float | None, out: Tensor) -> Tensor | None:
    """The gate as a rank-4 tensor broadcastable to out (B, Hq, T, D), each dimension 1 or full."""
    if gate is None:
        return None
    if isinstance(gate, (int, float)) and not isinstance(gate, bool):
        return torch.full((1, 1, 1, 1), float(gate), dtype=float_acc(out.dtype), device=out.device)
    if not isinstance(gate, Tensor) or not gate.is_floating_point():
        raise ValueError(f"gate must be a float or a floating-point tensor broadcastable to (B, Hq, T, D), got "
                         f"{type(gate).__name__ if not isinstance(gate, Tensor) else gate.dtype}")
    if gate.dim() != 4 or any(g not in (1, o) for g, o in zip(gate.shape, out.shape)):
        raise ValueError(f"gate must have rank 4 with each dimension 1 or that of (B, Hq, T, D) = "
                         f"{tuple(out.shape)}, e.g. (B, Hq, T, D) elementwise, (B, Hq, T, 1) per head, "
                         f"(1, Hq, 1, 1) a per-head scale; got {tuple(gate.shape)}")
    if gate.device != out.device:
        raise ValueError(f"gate is on {gate.device} but the attention output is on {out.device}")
    return gate


def epilogue(out: Tensor, *, alpha: Tensor | None = None, alpha_ma: Tensor | None = None,
             gate: Tensor | float | None = None, v_mean: Tensor | None = None, v: Tensor | None = None,
             mask: MaskSpec | None = None, bias_norm: str = "visible", impl: str | None = None) -> Tensor:
    """g * (alpha * out + (alpha_ma - alpha) * m), or g * out without alpha; returns out's dtype.

    out: (B, Hq, T, D) kernel output. alpha: (B, Hq, T); alpha_ma: (Hq,). The mean m comes either precomputed,
    v_mean: (B, Hkv|Hq, T|1, D) (broadcast over each group of Hq // Hkv query heads without a copy, e.g. from a
    decoding cache's running sum), or as v: (B, Hkv, S, D) with the mask it is averaged under (`ValueMean`).
    gate: broadcastable to (B, Hq, T, D) (elementwise (B, Hq, T, D), headwise (B, Hq, T, 1), a per-head scale
    (1, Hq, 1, 1)) or a constant float. Sums accumulate in float32 (float64 for float64). impl: "eager" or
    "triton" (default: triton on CUDA, eager elsewhere; see select_impl).
    """
    if not isinstance(out, Tensor) or out.dim() != 4:
        raise ValueError(f"out must be the (B, Hq, T, D) attention output, got "
                         f"{tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__}")
    name = select_impl(out.device, impl)
    g = gate4(gate, out)
    B, Hq, T, D = out.shape
    mean = None
    if alpha is None:
        if alpha_ma is not None or v_mean is not None or v is not None:
            raise ValueError("alpha_ma, v_mean and v belong to the affine part: pass alpha with them, or none")
        if g is None:
            return out
    else:
        check_per_query("alpha", alpha, B, Hq, T, out.device)
        check_per_head("alpha_ma", alpha_ma, Hq, out.device)
        if (v_mean is None) == (v is None) or (v is not None and not isinstance(mask, MaskSpec)):
            raise ValueError("the affine epilogue needs the mean of visible V: pass exactly one of v_mean "
                             "(B, Hkv, T|1, D) or v (B, Hkv, S, D) together with mask= (a MaskSpec)")
        if v_mean is not None:
            # Any head count that divides Hq broadcasts correctly here; the ops also check it is the call's Hkv.
            check_v_mean(v_mean, B, Hq, None, T, D, out.device)
        else:
            mean = ValueMean(mask, Hq, bias_norm)
            if not mean.has_transpose:
                v_mean, v, mean = mean.of(v), None, None  # differentiated by autograd, kept for backward
    if name == "triton" and v is None:
        return _kernels(name).forward(out, alpha, alpha_ma, v_mean, g)  # differentiable: its backward is registered
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad
                                              for t in (out, alpha, alpha_ma, g, v_mean, v)):
        if v is not None:
            v_mean = mean.detached(v)
        return _kernels(name).forward(out, alpha, alpha_ma, v_mean, g)  # nothing to differentiate: no node
    return _Epilogue.apply(name, out, alpha, alpha_ma, g, v_mean, v, mean)


def _kernels(name: str):
    if name == "triton":
        from .epilogue_triton import OPS
        return OPS
    return _eager


class _Epilogue(torch.autograd.Function):
    """Forward through one implementation; backward calls the same one, after recomputing m from v where it is a
    prefix sum (then d v comes from ValueMean's hand-written transpose). While compiling, nothing here returns a
    tensor made by an in-place or out= op, a raw Triton launch included: dynamo 2.11 silently gives such a Function
    zero gradients (the Triton kernels run here as registered operators, whose outputs are their own)."""

    @staticmethod
    def forward(ctx, name, out, alpha, alpha_ma, gate, v_mean, v, mean):
        m = v_mean if v is None else mean.detached(v)
        ctx.save_for_backward(out, alpha, alpha_ma, gate, v_mean, v)
        ctx.name, ctx.mean = name, mean
        return _kernels(name).forward(out, alpha, alpha_ma, m, gate)

    @staticmethod
    @once_differentiable("the variant epilogue")  # a second derivative raises, naming what to use instead
    def backward(ctx, grad):
        out, alpha, alpha_ma, gate, m, v = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_dv = v is not None and need[6]
        if v is not None:
            total, inv = ctx.mean.sums(v)
            m = total * inv
        d_out, d_alpha, d_alpha_ma, d_gate, d_m = _kernels(ctx.name).backward(
            grad, out, alpha, alpha_ma, m, gate, need_alpha=need[2], need_alpha_ma=need[3], need_gate=need[4],
            need_m=need[5] or need_dv)
        d_v = ctx.mean.transpose(d_m * inv, v) if need_dv else None
        return (None, d_out if need[1] else None, d_alpha, d_alpha_ma, d_gate, d_m if need[5] else None, d_v,
                None)


class _eager:
    """The combine as eager tensor ops, out of place (a compiled graph plans its own buffers, and dynamo 2.11 zeroes
    the gradients of a Function whose output an in-place op made). GQA: alpha is viewed as (B, Hm, G, T, 1) and m
    as (B, Hm, 1, T|1, D) with G = Hq // Hm query heads per head of m, so m is broadcast over its group, never
    copied. Layouts as `epilogue`."""

    @staticmethod
    def _terms(out: Tensor, alpha: Tensor, alpha_ma: Tensor, m: Tensor):
        """(out5, a, b, m5) in the accumulation dtype's views: out5 (B, Hm, G, T, D), a (B, Hm, G, T, 1),
        b = alpha_ma - a (the weight of m), m5 (B, Hm, 1, T|1, D)."""
        B, Hq, T, D = out.shape
        Hm = m.shape[1]
        acc = float_acc(out.dtype)
        a = as_dtype(alpha, acc).reshape(B, Hm, Hq // Hm, T, 1)
        b = as_dtype(alpha_ma, acc).reshape(1, Hm, Hq // Hm, 1, 1) - a
        return out.reshape(B, Hm, Hq // Hm, T, D), a, b, as_dtype(m, acc).unsqueeze(2)

    @staticmethod
    def _affine(out: Tensor, alpha: Tensor, alpha_ma: Tensor, m: Tensor) -> Tensor:
        """a * out + (alpha_ma - a) * m: (B, Hq, T, D) in the accumulation dtype. Not a * (out - m) + alpha_ma * m:
        where alpha == alpha_ma == 1 (a retrofitted model) m's weight is exactly 0 and y is out, bit for bit."""
        out5, a, b, m5 = _eager._terms(out, alpha, alpha_ma, m)
        return torch.addcmul(torch.mul(out5, a), b, m5).reshape(out.shape)

    @staticmethod
    def forward(out, alpha, alpha_ma, m, gate):
        y = out if alpha is None else _eager._affine(out, alpha, alpha_ma, m)
        if gate is not None:
            y = torch.mul(y, gate)
        return as_dtype(y, out.dtype)

    @staticmethod
    def backward(grad, out, alpha, alpha_ma, m, gate, *, need_alpha, need_alpha_ma, need_gate, need_m):
        """(d out, d alpha, d alpha_ma, d gate, d m), each None where not needed; d m is reduced to m's shape."""
        acc = float_acc(out.dtype)
        d_alpha = d_alpha_ma = d_gate = d_m = None
        if gate is not None and need_gate:
            y = as_dtype(out, acc) if alpha is None else _eager._affine(out, alpha, alpha_ma, m)
            d_gate = torch.mul(y, as_dtype(grad, acc)).sum_to_size(gate.shape).to(gate.dtype)
        dy = as_dtype(grad, acc) if gate is None else torch.mul(as_dtype(grad, acc), gate)  # (B, Hq, T, D) in acc
        if alpha is None:
            return dy.to(out.dtype), None, None, d_gate, None
        out5, a, b, m5 = _eager._terms(out, alpha, alpha_ma, m)
        dy5 = dy.reshape(out5.shape)
        d_out = torch.mul(dy5, a).to(out.dtype).reshape(out.shape)
        if need_alpha:
            d_alpha = torch.linalg.vecdot(dy5, out5 - m5).reshape(alpha.shape).to(alpha.dtype)
        if need_alpha_ma:
            d_alpha_ma = torch.linalg.vecdot(dy5, m5).sum((0, 3)).reshape(alpha_ma.shape).to(alpha_ma.dtype)
        if need_m:
            d_m = torch.mul(dy5, b).sum(2).sum_to_size(m.shape).to(m.dtype)
        return d_out, d_alpha, d_alpha_ma, d_gate, d_m


class ValueMean:
    """m = (sum of the values query i may see) / N_i, a linear map of v: (B, Hkv, S, D) -> (B, Hkv|Hq, T|1, D).

    Sums come from visible_sums.visible_sum_and_count (float32, float64 for float64). bias_norm "visible" divides by N_i,
    "full" by S (an ablation). Where the sums are prefix sums (`has_transpose`), the map's transpose is written out,
    so the epilogue recomputes m in backward instead of saving it. A plain class (not a frozen dataclass) with no
    __call__: dynamo 2.11 cannot call a frozen dataclass instance built inside the graph.
    """

    __slots__ = ("mask", "Hq", "bias_norm")

    def __init__(self, mask: MaskSpec, Hq: int, bias_norm: str = "visible"):
        self.mask, self.Hq, self.bias_norm = mask, Hq, bias_norm

    def __repr__(self) -> str:
        return f"ValueMean(mask={self.mask!r}, Hq={self.Hq}, bias_norm={self.bias_norm!r})"

    def sums(self, v: Tensor) -> tuple[Tensor, Tensor]:
        """(total, inv) with m = total * inv: total (B, Hkv|Hq, T|1, D) float32 (float64 for float64), inv = 1 / N
        broadcastable to it, (B|1, 1, T|1, 1)."""
        total, count = visible_sum_and_count(v, self.mask, self.Hq)
        if self.bias_norm == "visible":
            return total, count.clamp(min=1).reciprocal()
        return total, count.new_full((1, 1, 1, 1), 1.0 / max(self.mask.S, 1))

    def of(self, v: Tensor) -> Tensor:
        """m, differentiable through autograd (used where the transpose below does not apply)."""
        total, inv = self.sums(v)
        return total * inv

    def detached(self, v: Tensor) -> Tensor:
        """m without autograd: the epilogue differentiates it itself (`transpose`)."""
        with torch.no_grad():
            return self.of(v)

    @property
    def has_transpose(self) -> bool:
        """True for the masks whose sums are prefix sums (none, causal with T <= S, key padding)."""
        m = self.mask
        structured = m.dense is None and m.window is None and m.documents is None
        return structured and (not m.causal or m.causal_is_trivial or m.offset >= 0)

    def transpose(self, d_total: Tensor, v: Tensor) -> Tensor:
        """d v: (B, Hkv, S, D) in v.dtype from d_total: (B, Hkv, T|1, D), the gradient of `sums`' total, for
        has_transpose masks.

        Query i sees keys j <= i + S - T (all keys without a causal rule) that the key mask keeps, so
        d v_j = keep_j * (sum of d_total_i over the queries i that see j): a suffix sum over queries, which is the
        total less the prefix over the queries before j: c[-1] - c[j - off - 1] with c the prefix sums.
        """
        mk = self.mask
        B, Hkv, S, D = v.shape
        if not mk.causal or mk.causal_is_trivial:
            dv = d_total.sum(-2, keepdim=True).expand(B, Hkv, S, D)
        else:
            T, off = mk.T, mk.offset
            c = d_total.cumsum(-2)
            total = c[:, :, -1:]
            dv = torch.cat([total.expand(B, Hkv, off + 1, D), total - c[:, :, :T - 1]], dim=-2)
        if mk.keys is not None:
            dv = dv * mk.keys[:, :, 0, :, None]
        return dv.to(dtype=v.dtype, memory_format=torch.contiguous_format)
