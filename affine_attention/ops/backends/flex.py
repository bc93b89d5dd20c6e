"""FlexAttention on CUDA (torch.nn.attention.flex_attention): block-sparse fused Triton forward and backward for the
calls cuda_flash refuses (a logit softcap, a window with any key padding, documents without cu_seq_lens or with
padding, non-contiguous padding, dense masks), with a log-sum-exp that has a gradient of its own.

The mask becomes one BlockMask per mask object (so one per model forward at the seam, shared by every layer), built
from the MaskSpec by a mask_mod that reads only what the mask holds: no T x S tensor beyond a dense mask the caller
already made. Flex always runs compiled with fullgraph (eager flex materialises every T x S logit), on its Triton
backend, never FLASH (FA4 cannot give the sink's gradient through the lse).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from ..call import Score
from ..masks import MaskSpec
from .base import Backend, Call, register

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The head dims this backend takes (assumed from Triton's 16-wide dot tiles and the 256 flex's configs are tuned up
# to; not checked on a GPU yet).
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# Compilations of flex per process (dynamo's default for one function is 8).
RECOMPILE_LIMIT = 64


def _load_api():
    """(flex_attention, create_block_mask, AuxRequest, backend option supported) or a reason (str) why this torch
    cannot serve flex calls: AuxRequest (a differentiable lse through return_aux) is what the sink needs."""
    try:
        from torch.nn.attention import flex_attention as fa
    except ImportError as e:
        return f"this torch has no FlexAttention ({e})"
    if not hasattr(fa, "AuxRequest"):
        return (f"torch {torch.__version__}'s FlexAttention has no return_aux=AuxRequest(lse=True) (the lse the sink "
                "differentiates); upgrade torch")
    options = getattr(getattr(fa, "FlexKernelOptions", None), "__annotations__", {})
    return fa.flex_attention, fa.create_block_mask, fa.AuxRequest, "BACKEND" in options


# Resolved once at import (a compiled graph then reads a constant, no cache wrapper to trace).
_API = _load_api()


def _api():
    return _API


@functools.cache
def _platform_reason() -> str | None:
    """Why this process cannot run flex's CUDA kernels (None if it can). Tests on meta tensors patch this."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    from torch.utils._triton import has_triton

    if not has_triton():
        return "triton is not installed (flex compiles Triton kernels)"
    return None


def score_mod(softcap: float | None) -> Callable | None:
    """The flex score_mod of a call's score rule (None: the plain q.k * scale). Flex applies scale first, then
    this: c * tanh(x / c), Gemma 2's cap; its gradient is autograd's through the Triton backward."""
    if softcap is None:
        return None
    c = float(softcap)
    if c not in _CAPPED:  # one function object per cap value: graphs guard on it, every layer reuses one compilation
        def capped(score, b, h, q_idx, kv_idx):
            return c * torch.tanh(score / c)
        _CAPPED[c] = capped
    return _CAPPED[c]


_CAPPED: dict[float, Callable] = {}


def mask_mod(mask: MaskSpec) -> Callable:
    """The flex mask_mod of `mask`: (b, h, q_idx, kv_idx) -> may attend, bottom-right aligned as everywhere here
    (query i stands at position i + S - T). Reads the key padding (B|1, S), the document ids (B|1, S) and a dense
    mask (B|1, Hq|1, T|1, S|1) by index, so nothing larger than what the mask holds is ever built."""
    off, window, causal = mask.offset, mask.window, mask.causal
    keys = None if mask.keys is None else _reader(mask.keys[:, 0, 0, :])
    docs = None if mask.documents is None else _reader(mask.documents)
    dense = None if mask.dense is None else _reader(mask.dense)

    def visible(b, h, q_idx, kv_idx):
        pos = q_idx + off
        ok = kv_idx <= pos if causal else kv_idx >= 0
        if window is not None:
            ok = ok & (kv_idx > pos - window)
        if docs is not None:
            ok = ok & (docs(b, pos) == docs(b, kv_idx))
        if keys is not None:
            ok = ok & keys(b, kv_idx)
        if dense is not None:
            ok = ok & dense(b, h, q_idx, kv_idx)
        return ok
    return visible


def _reader(t: Tensor) -> Callable:
    """t: (n_1|1, ..., n_k|1) -> f(i_1, ..., i_k) = t[i_1, ..., i_k], a broadcast dimension read at 0.

    Flex evaluates mask_mod on whole blocks, past the last query and key (T, S rounded up to its block size): an
    index is clamped into range, never read out of bounds (on CPU that corrupted the heap); the kernel itself hides
    the positions past T and S. The broadcast dimensions are selected away first and the rest read by one advanced
    index of tensors only: under vmap inside dynamo an int index beside tensor ones fails, and chained indexing
    (t[i][j]) compiles to a CPU kernel that corrupts the heap (torch 2.13)."""
    keep = [(d, t.shape[d]) for d in range(t.dim()) if t.shape[d] > 1]
    for d in reversed(range(t.dim())):
        if t.shape[d] == 1:
            t = t.select(d, 0)

    def read(*idx):
        return t[tuple(idx[d].clamp(0, n - 1) for d, n in keep)] if keep else t
    return read


def _block_mask_shape(mask: MaskSpec, B: int, Hq: int) -> tuple[int, int]:
    """(B, H) of the block mask: 1 where every row (head) shares one pattern, so it is built once for all of them."""
    per_row = any(t is not None and t.shape[0] > 1 for t in (mask.keys, mask.documents, mask.dense))
    per_head = mask.dense is not None and mask.dense.shape[1] > 1
    return (B if per_row else 1), (Hq if per_head else 1)


def build_block_mask(mask: MaskSpec, B: int, Hq: int, device: torch.device):
    """The BlockMask of `mask` (None where the mask hides nothing: flex then attends everywhere)."""
    if not mask.kinds:
        return None
    # Eager create_block_mask evaluates mask_mod on (B, H, T, S) index tensors; compiled (as torchtitan and
    # transformers build theirs) it fuses that into the block reduction. Inside a graph it is compiled with it.
    create = _compiled_create() if device.type == "cuda" and not torch.compiler.is_compiling() else _api()[1]
    Bm, Hm = _block_mask_shape(mask, B, Hq)
    return create(mask_mod(mask), Bm, Hm, mask.T, mask.S, device=device)


def block_mask(mask: MaskSpec, B: int, Hq: int, device: torch.device):
    """build_block_mask once per mask object (every layer of a model forward shares the MaskSpec, so one block mask
    serves all of them, forward and backward)."""
    return mask.derived(("flex.block_mask", B, Hq, str(device)), lambda: build_block_mask(mask, B, Hq, device))


_COMPILED: list[Callable] = []


def _compiled() -> Callable:
    """flex_attention compiled once per process. fullgraph: a call that cannot compile raises; it never runs flex's
    eager path (every T x S logit)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(_api()[0], fullgraph=True))
    return _COMPILED[0]


def _compiled_create() -> Callable:
    """create_block_mask compiled once per process (not fullgraph: a graph break costs speed, never the result)."""
    if not _CREATE:
        _CREATE.append(torch.compile(_api()[1]))
    return _CREATE[0]


_CREATE: list[Callable] = []


def kernel_options(with_lse: bool) -> dict | None:
    """Pinned to the Triton kernels where the sink trains through the lse: FLASH (FA4) has no lse gradient."""
    return {"BACKEND": "TRITON"} if with_lse and _api()[3] else None


def _flex(q: Tensor, k: Tensor, v: Tensor, bm, mod, scale: float, with_lse: bool):
    flex, _, aux, _ = _api()
    kw = dict(score_mod=mod, block_mask=bm, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
              kernel_options=kernel_options(with_lse), return_aux=aux(lse=True) if with_lse else None)
    if torch.compiler.is_compiling():  # inside the caller's graph, which is compiled as a whole
        out = flex(q, k, v, **kw)
    else:
        # Every (dtype, mask structure, score rule) is its own kernel, so flex gets a wider recompile limit than
        # dynamo's 8; past it dynamo would silently run flex eagerly (T x S): an error instead.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
            out = _compiled()(q, k, v, **kw)
    return (out[0], out[1].lse) if with_lse else (out, None)


@register
class FlexBackend(Backend):
    name = "flex"
    priority = 25  # after cuda_flash (FA2 is faster where it applies), before the exact T x S fallback
    has_lse = False  # no raw pair: the lse comes differentiable from attention()
    differentiable_lse = True
    score = frozenset({"softcap"})  # a score_mod; other score functions stay with exact (opaque to graph guards)
    layout = "last_dim_contiguous"

    def supports(self, call: Call) -> str | None:
        if call.device_type != "cuda":
            return f"runs on CUDA only (got {call.device_type}; torch has no flex backward on CPU)"
        api = _api()
        if isinstance(api, str):
            return api
        why = _platform_reason()
        if why is not None:
            return why
        if call.dtype not in DTYPES:
            return f"dtype {call.dtype} (float16, bfloat16 or float32)"
        if not MIN_HEAD_DIM <= call.D <= MAX_HEAD_DIM:
            return f"head dim {call.D} (from {MIN_HEAD_DIM} to {MAX_HEAD_DIM})"
        if min(call.B, call.T, call.S) == 0:
            return f"an empty dimension (B, T, S) = {(call.B, call.T, call.S)}"
        return None

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, score: Score, *,
                  with_lse: bool = False) -> tuple[Tensor, Tensor | None]:
        """q: (B, Hq, T, D); k, v: (B, Hkv, S, D) -> out (B, Hq, T, D) q.dtype, lse (B, Hq, T) float32 (-inf for a
        query that sees no key, whose out is 0) or None; both differentiable."""
        B, Hq = q.shape[:2]
        bm = block_mask(mask, B, Hq, q.device)
        return _flex(q, k, v, bm, score_mod(score.softcap), score.scale, with_lse)
