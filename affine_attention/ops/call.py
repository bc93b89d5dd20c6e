"""The per-call object every attention layer call is described by, from the transformers seam to the kernel:
(q, k, v, mask: MaskSpec, score: Score, cache: CacheHints), built once per call and read by variants, backends,
probes and recorders. `AttentionCall.of` is the one place the ops' keyword dialect (attn_mask, is_causal, window,
document_ids, scale, softcap) becomes this object; below the public entry points only the object exists."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ._validate import check_per_query, check_qkv, check_scale, check_softcap
from .masks import MaskSpec, mask_of_call
from .visible_sums import visible_sum_and_count


class Softcap(NamedTuple):
    """The score function c * tanh(x / c) (Gemma 2's logit cap): one user of the score hook, a named type so that
    kernels with a native cap (FlashAttention, flex) recognise it, where any other function is opaque."""

    cap: float

    def __call__(self, x: Tensor) -> Tensor:
        return self.cap * torch.tanh(x / self.cap)

    def derivative(self, x: Tensor) -> Tensor:
        """d/dx of the cap at the uncapped logits x: 1 - tanh^2(x / c)."""
        t = torch.tanh(x / self.cap)
        return 1 - t * t


class Score(NamedTuple):
    """How logits are made from q.k: x_ij = fn(q_i.k_j * scale * q_scale_i), fn the identity when None.

    scale: the usual 1 / sqrt(D) (or the model's). q_scale: (B|1, Hq, T) a per-head, per-query multiplier of the
    logits, or None; exact for every backend, since the dispatcher folds it into q ((s q).k = s (q.k)) and autograd
    carries its gradient. fn: an elementwise function of the scaled logits (Softcap, or any differentiable
    torch function without parameters of its own), applied only by backends that declare its kind (`kind`) and by
    the reference; a backend that cannot apply it is never handed the call.
    """

    scale: float
    q_scale: Tensor | None = None
    fn: Callable[[Tensor], Tensor] | None = None

    @property
    def softcap(self) -> float | None:
        """The cap when fn is Softcap (what kernels with a native cap read), else None."""
        return self.fn.cap if isinstance(self.fn, Softcap) else None

    @property
    def kind(self) -> str | None:
        """What a backend must apply inside its kernel: "softcap", "score_fn" (any other function) or None."""
        if self.fn is None:
            return None
        return "softcap" if isinstance(self.fn, Softcap) else "score_fn"

    def logits(self, qk: Tensor) -> Tensor:
        """(B, Hq, T, S) raw q.k -> the logits the softmax sees (q_scale applied here too: for the references)."""
        x = qk * self.scale
        if self.q_scale is not None:
            x = x * self.q_scale.to(x.dtype)[..., None]
        return x if self.fn is None else self.fn(x)

    def with_q_scale(self, q_scale: Tensor) -> "Score":
        """This score with its logits further multiplied by q_scale: (B|1, Hq, T) (multiplies an existing one)."""
        return self._replace(q_scale=q_scale if self.q_scale is None else self.q_scale * q_scale)


def _counts(mask: MaskSpec, T: int, dtype: torch.dtype, device) -> Tensor:
    rows = max([t.shape[0] for t in (mask.keys, mask.dense, mask.documents) if t is not None], default=1)
    _, count = visible_sum_and_count(torch.ones(rows, 1, mask.S, 1, dtype=dtype, device=device), mask, 1)
    count = count[..., 0].to(dtype)  # (B|1, 1|Hq, T|1)
    return count.expand(*count.shape[:2], T)


def make_score(scale: float | None, softcap: float | None, D: int) -> Score:
    """The score of the keyword dialect: scale (None: 1 / sqrt(D)) and softcap (None: no cap), both checked."""
    cap = check_softcap(softcap)
    return Score(check_scale(scale, D), None, None if cap is None else Softcap(cap))


class CacheHints(NamedTuple):
    """What a decoding cache knows about this call, to spare work; None = not known.

    v_mean: (B, Hkv, T, D) float32 mean of the visible values (the cache's running sum), same bias_norm as the
    variant's; kv_nonfinite: (B, Hkv) bool, the heads whose cached k or v hold a non-finite row, or False for none."""

    v_mean: Tensor | None = None
    kv_nonfinite: Tensor | bool | None = None


class AttentionCall(NamedTuple):
    """One attention layer call. q: (B, Hq, T, D); k, v: (B, Hkv, S, D); mask: which keys each query sees;
    score: how logits are made; cache: what a decoding cache knows; backend: a kernel forced by name, or None.
    A NamedTuple: built on every layer call, cheap, and traceable by torch.compile."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: MaskSpec
    score: Score
    cache: CacheHints = CacheHints()
    backend: str | None = None

    @property
    def enable_gqa(self) -> bool:
        return self.q.shape[1] != self.k.shape[1]

    def visible_counts(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """(B|1, 1|Hq, T): how many keys each query sees under the call's mask, what a score hook that depends on
        it reads (e.g. scalable softmax's log N). Structured masks are counted without a T x S tensor, once per
        mask object (every layer of a forward shares it)."""
        mask, T = self.mask, self.q.shape[2]
        return mask.derived(("visible_counts", dtype, self.q.device), lambda: _counts(mask, T, dtype, self.q.device))

    @staticmethod
    def of(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None, is_causal: bool = False,
           window: int | None = None, document_ids: Tensor | None = None, mask: MaskSpec | None = None,
           scale: float | None = None, softcap: float | None = None, score: Score | None = None,
           enable_gqa: bool = True, v_mean: Tensor | None = None, kv_nonfinite: Tensor | bool | None = None,
           backend: str | None = None) -> "AttentionCall":
        """The call of the ops' keyword dialect, every part checked: the mask as `mask` (a MaskSpec) or the
        keywords attn_mask / is_causal / window / document_ids (not both); the score as `score` or scale / softcap
        (not both). enable_gqa=False refuses Hq != Hkv, as torch's SDPA does."""
        B, Hq, Hkv, T, S, D = check_qkv(q, k, v, enable_gqa)
        spec = mask_of_call(mask, attn_mask, is_causal, window, document_ids, B, Hq, T, S, q.device)
        if score is None:
            score = make_score(scale, softcap, D)
        elif not isinstance(score, Score) or scale is not None or softcap is not None:
            raise ValueError("pass the score once: either score= (an ops.call.Score) or scale / softcap, not both")
        elif score.q_scale is not None:
            qs = score.q_scale  # (B|1, Hq, T): one batch row broadcasts
            check_per_query("score.q_scale", qs, 1 if isinstance(qs, Tensor) and qs.shape[:1] == (1,) else B, Hq, T,
                            q.device)
        return AttentionCall(q, k, v, spec, score, CacheHints(v_mean, kv_nonfinite), backend)
