"""The one mask object every attention path reads: (attn_mask, is_causal, window, documents) parsed and validated once,
kept structured (no T x S tensor except for a dense mask), with the per-mask facts the kernels derive from it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor


class Varlen(NamedTuple):
    """Packed documents in FlashAttention's varlen form, as transformers passes them (DataCollatorWithFlattening with
    return_flash_attn_kwargs=True): cumulative query / key lengths (n_docs + 1,) int32 and the longest document.
    Made outside the model, so a compiled graph needs no host sync to get them."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int


class KeyRuns(NamedTuple):
    """What one host read of key padding tells the kernels, made where reading is allowed (eagerly: the seam's mask
    function, once per model forward) and carried into compiled code, which cannot read values (`read_key_runs`).

    keys: the (B|1, 1, 1, S) bool tensor they were read from; they hold for it alone (MaskSpec refuses them beside
      any other tensor, and a compiled graph guards on their values, so a graph made for one mask's facts is never
      reused for another's).
    contiguous: every row's valid keys are one run; right: some row has padding after its last valid key."""

    keys: Tensor
    contiguous: bool
    right: bool


def key_spans(keys: Tensor, B: int) -> tuple[Tensor, Tensor, Tensor]:
    """keys: (B|1, 1, 1, S) bool -> first, end (B,) int64: the run [first, end) of each row's valid keys, and
    contiguous (B,) bool (False where the valid keys are not one run). A row without a valid key has first = end = S.
    Computed on the device (no host sync)."""
    S = keys.shape[-1]
    keys = keys.reshape(keys.shape[0], S).expand(B, S)
    n = keys.sum(1)
    first = keys.int().argmax(1)
    end = S - keys.flip(1).int().argmax(1)
    none = n == 0
    first, end = first.masked_fill(none, S), end.masked_fill(none, S)
    return first, end, none | (n == end - first)


def read_key_runs(keys: Tensor) -> tuple[bool, KeyRuns] | None:
    """keys: (B|1, 1, 1, S) bool -> (every key valid, the KeyRuns of `keys`) in one host sync; None where values
    cannot be read (compiling, meta tensors)."""
    if torch.compiler.is_compiling() or keys.device.type == "meta":
        return None
    first, end, contiguous = key_spans(keys, keys.shape[0])
    every, runs, right = torch.stack([keys.all(), contiguous.all(), ((end < keys.shape[-1]) & (first < end)).any()
                                      ]).tolist()
    return bool(every), KeyRuns(keys, bool(runs), bool(right))


@dataclass(frozen=True)
class MaskSpec:
    """Which keys each query may see.

    causal: bottom-right aligned (query i sees keys j <= i + S - T), as cached decoding needs;
      torch SDPA aligns top-left, which is wrong once queries follow a cache.
    keys: (B|1, 1, 1, S) bool, a key-only mask (padding); None if absent.
    dense: bool broadcastable to (B, Hq, T, S), any other mask; None if absent. Forces the exact slow paths.
    window: each query sees at most its last `window` keys, itself included (transformers' sliding_window),
      bottom-right aligned: query i sees key j iff i + S - T - window < j; always combined with causal.
    documents: (B|1, S) int64 document id of every key position, non-decreasing along S (packed rows); query i
      has the id of key position i + S - T and sees only keys of its own document. None if absent.
    varlen: the same documents as cumulative lengths, when the caller has them (one packed row, T == S).
    key_runs: KeyRuns read from `keys` itself where values could be read (see `runs`); None if not read.

    Built once per op call, or once per model forward at the transformers seam and shared by every layer, so what a
    kernel derives from it (`derived`: varlen segments, host-side checks) is computed once per forward, not per layer.
    """

    T: int
    S: int
    causal: bool
    keys: Tensor | None
    dense: Tensor | None
    window: int | None = None
    documents: Tensor | None = None
    varlen: Varlen | None = None
    key_runs: KeyRuns | None = field(default=None, repr=False, compare=False)

    # Read several times per op call (isolation, backend choice, the mean of V): computed once, at construction.
    kinds: frozenset[str] = field(init=False, repr=False, compare=False)
    # What kernels derive from this mask, by key (see `derived`); lives as long as the mask, i.e. one forward.
    _derived: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        """kinds: the mask kinds in force, a subset of {"causal", "keys", "window", "documents", "dense"}; a backend
        declares which it handles. A causal rule that hides nothing (one query after its cache) is not listed."""
        kinds = set()
        if self.causal and not self.causal_is_trivial:
            kinds.add("causal")
        if self.keys is not None:
            kinds.add("keys")
        if self.window is not None and self.window < self.S:
            kinds.add("window")
        if self.documents is not None:
            kinds.add("documents")
        if self.dense is not None:
            kinds.add("dense")
        object.__setattr__(self, "kinds", frozenset(kinds))
        object.__setattr__(self, "_derived", {})
        runs = self.key_runs
        if runs is not None and (not isinstance(runs, KeyRuns) or runs.keys is not self.keys):
            raise ValueError("key_runs hold for the tensor they were read from, and this mask's keys are another "
                             "(or absent): read them from the key mask itself with masks.read_key_runs")

    def runs(self) -> KeyRuns | None:
        """The key padding's KeyRuns: those carried in (read eagerly, e.g. by the seam's mask function), else read
        here once per mask object (one host sync), else None (compiling without them, meta tensors)."""
        if self.keys is None or self.key_runs is not None:
            return self.key_runs
        read = self.derived("masks.key_runs", lambda: read_key_runs(self.keys))
        return None if read is None else read[1]

    def derived(self, key: Any, make: Callable[[], Any]) -> Any:
        """make(), computed once per mask object and key: every layer of a forward shares the mask, so work a kernel
        derives from it (segment tables, a host-side check) runs once per forward. Not remembered while compiling:
        a graph derives its values once at trace time anyway."""
        if torch.compiler.is_compiling():
            return make()
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def host_facts_known(self) -> bool:
        """Whether values of the mask tensors may be read on the host (a sync): not while compiling (a graph cannot
        branch on them) nor on the meta device (they have none)."""
        t = next((x for x in (self.keys, self.documents, self.dense) if x is not None), None)
        return not torch.compiler.is_compiling() and (t is None or t.device.type != "meta")

    @property
    def offset(self) -> int:
        return self.S - self.T

    @property
    def causal_is_trivial(self) -> bool:
        """True when the causal mask hides nothing (a single query after its whole cache)."""
        return self.causal and self.T == 1 and self.S >= 1

    @property
    def causal_square(self) -> bool:
        """True when bottom-right and top-left alignment coincide, so any causal kernel is right."""
        return self.causal and self.T == self.S

    def causal_bool(self, device: torch.device) -> Tensor:
        """(T, S) bool: query i sees key j iff j <= i + S - T."""
        i = torch.arange(self.T, device=device)[:, None]
        j = torch.arange(self.S, device=device)[None, :]
        return j <= i + self.offset

    def dense_bool(self, device: torch.device) -> Tensor:
        """Everything combined as one bool mask broadcastable to (B, Hq, T, S); used only on exact slow paths."""
        return self.chunk_bool(0, self.T, device)

    def chunk_bool(self, start: int, stop: int, device: torch.device, key_start: int = 0,
                   key_stop: int | None = None) -> Tensor:
        """Visibility of queries start..stop-1 over keys key_start..key_stop-1 (default: all S) as one bool mask
        broadcastable to (B, Hq, stop - start, key_stop - key_start)."""
        key_stop = self.S if key_stop is None else key_stop
        i = torch.arange(start, stop, device=device)[:, None] + self.offset  # absolute position of each query
        j = torch.arange(key_start, key_stop, device=device)[None, :]
        m = torch.ones(stop - start, key_stop - key_start, dtype=torch.bool, device=device)
        if self.causal:
            m = m & (j <= i)
        if self.window is not None:
            m = m & (j > i - self.window)
        m = m[None, None]
        if self.documents is not None:
            qdoc = self.documents[:, self.offset + start:self.offset + stop]  # (B|1, C)
            m = m & (qdoc[:, None, :, None] == self.documents[:, None, None, key_start:key_stop])
        if self.keys is not None:
            m = m & self.keys[..., key_start:key_stop]
        if self.dense is not None:
            d = self.dense if self.dense.shape[2] == 1 else self.dense[:, :, start:stop]
            m = m & (d if d.shape[3] == 1 else d[..., key_start:key_stop])
        return m

    def key_ranges(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(lo, hi): (B|1, T) int64; causal, window and documents let query i see at most keys lo_i <= j < hi_i
        (key padding and dense masks may hide more). Both are non-decreasing in i; an empty range has lo = hi."""
        p = torch.arange(self.T, device=device) + self.offset  # absolute position of each query
        hi = p + 1 if self.causal else torch.full_like(p, self.S)
        lo = p - self.window + 1 if self.window is not None else torch.zeros_like(p)
        lo, hi = lo[None], hi[None]
        if self.documents is not None:
            docs = self.documents.contiguous()
            qdoc = docs[:, self.offset:].contiguous()  # (B|1, T): documents need T <= S (parse_mask)
            lo = torch.maximum(lo, torch.searchsorted(docs, qdoc, side="left"))
            hi = torch.minimum(hi, torch.searchsorted(docs, qdoc, side="right"))
        lo = lo.clamp(0, self.S)
        return lo, torch.maximum(hi.clamp(0, self.S), lo)

    def static_key_range(self, start: int, stop: int) -> tuple[int, int]:
        """Keys [lo, hi) that queries start..stop-1 can see under causal and window, from the shapes alone (no
        look at documents or padding, so no host sync): the band a block of queries needs."""
        hi = min(self.S, stop + self.offset) if self.causal else self.S
        lo = max(0, start + self.offset - self.window + 1) if self.window is not None else 0
        return min(lo, max(hi, 0)), max(hi, 0)


def _check_window(window, is_causal: bool) -> int | None:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int (each query sees at most its last `window` keys, itself "
                         f"included) or None, got {window!r}")
    if not is_causal:
        raise ValueError("window needs is_causal=True: the sliding window counts back from each query's own "
                         "position (transformers' sliding_window); for other patterns pass a boolean attn_mask")
    return window


def _check_documents(document_ids, B: int, T: int, S: int, device: torch.device) -> Tensor | None:
    if document_ids is None:
        return None
    if not isinstance(document_ids, Tensor):
        raise ValueError(f"document_ids must be an integer tensor of shape (B, S) or None, got "
                         f"{type(document_ids).__name__}")
    if document_ids.is_floating_point() or document_ids.is_complex() or document_ids.dtype == torch.bool:
        raise ValueError(f"document_ids must be an integer tensor (one document id per key position), got dtype "
                         f"{document_ids.dtype}")
    if document_ids.dim() != 2 or document_ids.shape[0] not in (1, B) or document_ids.shape[1] != S:
        raise ValueError(f"document_ids must have shape (B, S) = {(B, S)} (queries are the last T = {T} "
                         f"positions), got {tuple(document_ids.shape)}")
    if T > S:
        raise ValueError(f"document_ids needs T <= S (queries are the last T of the S key positions), got T = {T} "
                         f"and S = {S}")
    if document_ids.device != device:
        raise ValueError(f"document_ids is on {document_ids.device} but q is on {device}")
    # A host sync: once per op call, or once per model forward at the seam (which builds one MaskSpec per forward).
    if S > 1 and document_ids.device.type != "meta" and not torch.compiler.is_compiling() and \
            bool((document_ids[:, 1:] < document_ids[:, :-1]).any()):
        raise ValueError("document_ids must be non-decreasing along each row (packed documents one after another); "
                         "for other patterns pass a boolean attn_mask")
    return document_ids.long()


def _check_varlen(varlen, documents: Tensor | None, B: int, T: int, S: int, device) -> Varlen | None:
    if varlen is None:
        return None
    if not isinstance(varlen, Varlen):
        raise ValueError(f"varlen must be a masks.Varlen(cu_q, cu_k, max_q, max_k) or None, got {type(varlen).__name__}")
    if documents is None or B != 1 or T != S:
        raise ValueError("varlen (cumulative document lengths) describes one packed row without a cache: it needs "
                         f"document_ids of that row, B = 1 and T = S; got B = {B}, T = {T}, S = {S}, document_ids "
                         f"{'given' if documents is not None else 'missing'}")
    for name in ("cu_q", "cu_k"):
        cu = getattr(varlen, name)
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.dtype != torch.int32 \
                or cu.device != device:
            raise ValueError(f"varlen.{name} must be a 1-D int32 tensor of cumulative lengths on {device}, got "
                             f"{cu.dtype if isinstance(cu, Tensor) else type(cu).__name__} of shape "
                             f"{tuple(getattr(cu, 'shape', ()))}")
    for name in ("max_q", "max_k"):
        n = getattr(varlen, name)
        if isinstance(n, torch.SymInt):  # a dynamic shape under torch.compile: checked where it is made
            continue
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= S:
            raise ValueError(f"varlen.{name} must be an int in [1, {S}] (the longest document), got {n!r}")
    return varlen


def parse_mask(attn_mask: Tensor | None, is_causal: bool, B: int, Hq: int, T: int, S: int,
               device: torch.device, *, window: int | None = None, document_ids: Tensor | None = None,
               varlen: Varlen | None = None, key_runs: KeyRuns | None = None) -> MaskSpec:
    """Validate attn_mask (bool, broadcastable to (B, Hq, T, S), True = may attend), window, document_ids
    ((B, S) int), varlen (the same documents as cumulative lengths, see Varlen) and key_runs (read from attn_mask
    itself, a (B|1, 1, 1, S) key mask, by read_key_runs), and classify them."""
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
    window = _check_window(window, is_causal)
    documents = _check_documents(document_ids, B, T, S, device)
    varlen = _check_varlen(varlen, documents, B, T, S, device)
    if key_runs is not None and (not isinstance(key_runs, KeyRuns) or key_runs.keys is not attn_mask):
        raise ValueError("key_runs must be the masks.KeyRuns read from attn_mask itself (read_key_runs(attn_mask)); "
                         "facts read from another tensor would describe another mask")
    if attn_mask is None:
        return MaskSpec(T, S, is_causal, None, None, window, documents, varlen)
    if not isinstance(attn_mask, Tensor):
        raise ValueError(f"attn_mask must be a bool tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool:
        raise ValueError(
            f"attn_mask must be a boolean tensor (True = may attend), got dtype {attn_mask.dtype}; "
            "convert an additive float mask with `attn_mask = additive_mask > float('-inf')`")
    if attn_mask.dim() > 4 or attn_mask.dim() < 1:
        raise ValueError(f"attn_mask must have rank 1..4, broadcastable to (B, Hq, T, S) = {(B, Hq, T, S)}, "
                         f"got shape {tuple(attn_mask.shape)}")
    m = attn_mask if attn_mask.dim() == 4 else attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    for size, want, name in zip(m.shape, (B, Hq, T, S), ("B", "Hq", "T", "S")):
        if size != 1 and size != want:  # not `in (1, want)`: dynamo misreads `in` on SymInts
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, Hq, T, S) = "
                             f"{(B, Hq, T, S)}: its {name} dimension is {size}, expected 1 or {want}")
    if m.device != device:
        raise ValueError(f"attn_mask is on {m.device} but q is on {device}")
    if m.shape[1] == 1 and m.shape[2] == 1:
        # A key mask always spans S (a (..., 1) mask broadcast over keys would count 1 visible key, not S).
        keys = m if m.shape[3] == S else m.expand(*m.shape[:3], S)
        if key_runs is not None:  # read from attn_mask, of which keys is a view made here
            key_runs = key_runs._replace(keys=keys)
        return MaskSpec(T, S, is_causal, keys, None, window, documents, varlen, key_runs)
    if key_runs is not None:
        raise ValueError(f"key_runs describe a key mask (B|1, 1, 1, S), but attn_mask {tuple(attn_mask.shape)} "
                         "varies over queries or heads")
    return MaskSpec(T, S, is_causal, None, m, window, documents, varlen)


def mask_of_call(mask: MaskSpec | None, attn_mask: Tensor | None, is_causal: bool, window: int | None,
                 document_ids: Tensor | None, B: int, Hq: int, T: int, S: int, device: torch.device) -> MaskSpec:
    """The one parsed mask of a call that takes either `mask` (parsed before, e.g. once per model forward) or the op
    keywords attn_mask / is_causal / window / document_ids, never both."""
    if mask is None:
        return parse_mask(attn_mask, is_causal, B, Hq, T, S, device, window=window, document_ids=document_ids)
    if not isinstance(mask, MaskSpec):
        raise ValueError(f"mask must be a MaskSpec (from masks.parse_mask) or None, got {type(mask).__name__}")
    if attn_mask is not None or is_causal is not False or window is not None or document_ids is not None:
        raise ValueError("pass the mask once: either mask= (a parsed MaskSpec) or the keywords attn_mask, is_causal, "
                         "window and document_ids, not both")
    if mask.T != T or mask.S != S:
        raise ValueError(f"mask was parsed for T = {mask.T} queries and S = {mask.S} keys, but q and k have T = {T} "
                         f"and S = {S}")
    _check_parsed_for(mask, B, Hq, device)
    return mask


def _check_parsed_for(mask: MaskSpec, B: int, Hq: int, device: torch.device) -> None:
    """A MaskSpec parsed for another batch, head count or device fails deep in a kernel with a broadcasting error:
    name the mismatch here. keys (B|1, 1, 1, S), dense (B|1, Hq|1, T, S), documents (B|1, S), varlen."""
    parts = (("keys", mask.keys, ("B",)), ("dense", mask.dense, ("B", "Hq")), ("documents", mask.documents, ("B",)))
    want = {"B": B, "Hq": Hq}
    for name, t, dims in parts:
        if t is None:
            continue
        for size, dim in zip(t.shape, dims):
            if size != 1 and size != want[dim]:
                raise ValueError(f"mask was parsed for {dim} = {size} (its {name}: {tuple(t.shape)}), but q has "
                                 f"{dim} = {want[dim]}; parse the mask for this call (masks.parse_mask) or pass "
                                 "attn_mask instead")
        if t.device != device:
            raise ValueError(f"mask was parsed on {t.device} (its {name}), but q is on {device}; parse it on q's "
                             "device or pass attn_mask instead")
    if mask.varlen is not None and mask.varlen.cu_q.device != device:
        raise ValueError(f"mask was parsed on {mask.varlen.cu_q.device} (its varlen lengths), but q is on {device}; "
                         "parse it on q's device")
