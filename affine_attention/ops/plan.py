"""The dispatch table: for every mask kind the library knows, which backend serves the call and why each one the
automatic choice asks before it refuses; planned without running a kernel, so it prints on a CPU-only machine.

Three modes (MODES): eager calls are planned on CPU tensors that hold the mask's values (what eager host checks read);
compiled calls on meta tensors (whose values, as inside a compiled graph, cannot be read). Key padding reaches the
layers as the seam's mask function hands it: where that function runs eagerly (eager, and models whose decoder
layers are compiled one by one) it reads the mask once, drops an all-True one and attaches its runs; where the whole
model is traced, the mask stays and its runs are unknown. The call's device type is the asked one; backends with a
platform check (CUDA present, flash kernels built, triton) are asked as on a machine that passes it, unless this
machine has that device: then they answer for it.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import NamedTuple

import torch

from . import backends
from .backends.base import Call
from .call import make_score
from .masks import KeyRuns, Varlen, parse_mask, read_key_runs

B, HQ, HKV, D, T, S = 2, 8, 2, 128, 256, 256
#: The device types the backends tell apart (each declares "runs on CUDA only" or "on CPU only"); any other would be
#: planned as a guess.
PLANNED_DEVICES = ("cpu", "cuda")


def device_type_of(device: str) -> str:
    """The device type a plan is made for: "cuda" for "cuda" or "cuda:0" (a plan is per type); ValueError naming the
    value for a string torch does not read as a device or a type no backend declares."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in PLANNED_DEVICES:
        raise ValueError(f"device {device!r} cannot be planned for: use one of {', '.join(PLANNED_DEVICES)} (an index "
                         f"such as cuda:0 is allowed; the plan is the same for every device of a type)")
    return kind

#: mode -> how the table's heading names it.
MODES = {"eager": "eager",
         "blocks": "compiled per decoder block, padding read once per forward by the eager mask function",
         "model": "compiled whole model, padding not read (the mask function traced)"}


class Case(NamedTuple):
    """One mask kind: T queries over S keys; keys: (first, end) of the valid keys per row, or a list of (B, S) bools;
    docs: document lengths of one packed row; varlen: with the collator's cu_seq_lens; dense: an arbitrary mask."""

    name: str
    T: int = T
    S: int = S
    window: int | None = None
    keys: tuple | None = None
    docs: tuple | None = None
    varlen: bool = False
    dense: bool = False
    softcap: float | None = None
    batch: int = B


CASES = [
    Case("causal"),
    Case("causal after a cache (chunked prefill, T < S)", T=64),
    Case("padding, all True (attention_mask of ones)", keys=((0, 256), (0, 256))),
    Case("padding, right", keys=((0, 200), (0, 256))),
    Case("padding, left", keys=((56, 256), (0, 256))),
    Case("padding, both sides", keys=((10, 200), (0, 256))),
    Case("padding, not contiguous", keys="holes"),
    Case("window", window=64),
    Case("window + all-True padding", window=64, keys=((0, 256), (0, 256))),
    Case("window + left padding", window=64, keys=((56, 256), (0, 256))),
    Case("window + right padding", window=64, keys=((0, 200), (0, 256))),
    Case("documents with cu_seq_lens", docs=(100, 60, 96), varlen=True, batch=1),
    Case("documents without cu_seq_lens", docs=(100, 60, 96), batch=1),
    Case("documents + padding", docs=(100, 60, 96), keys=((0, 200),), batch=1),
    Case("dense mask", dense=True),
    Case("softcap (Gemma 2)", softcap=50.0),
    Case("softcap + window + padding", softcap=50.0, window=64, keys=((0, 200), (0, 256))),
    Case("decoding (T = 1)", T=1),
    Case("decoding + padding", T=1, keys=((56, 256), (0, 256))),
    Case("decoding + window + padding", T=1, window=64, keys=((56, 256), (0, 256))),
]


def _mask(case: Case, mode: str):
    """The case's MaskSpec as the layers of `mode` get it: tensors on CPU (eager: values readable) or meta (compiled:
    not); key padding as the seam's mask function hands it (read where it runs eagerly, see the module docstring)."""
    device = torch.device("cpu" if mode == "eager" else "meta")
    b = case.batch
    keys = docs = varlen = dense = runs = None
    if case.keys == "holes":
        keys = torch.ones(b, 1, 1, case.S, dtype=torch.bool)
        keys[0, ..., 40:60] = False
    elif case.keys is not None:
        keys = torch.zeros(b, 1, 1, case.S, dtype=torch.bool)
        for row, (first, end) in enumerate(case.keys):
            keys[row, ..., first:end] = True
    if keys is not None and mode != "model":
        every, runs = read_key_runs(keys)
        keys = None if every else keys.to(device)
        # The runs read from the CPU values, for the copy on `device` that stands for them.
        runs = None if keys is None else KeyRuns(keys, runs.contiguous, runs.right)
    if case.docs is not None:
        lengths = torch.tensor(case.docs)
        docs = torch.repeat_interleave(torch.arange(len(case.docs)), lengths)[None]
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
        varlen = Varlen(cu.to(device), cu.to(device), max(case.docs), max(case.docs)) if case.varlen else None
    if case.dense:
        dense = torch.rand(b, 1, case.T, case.S, generator=torch.Generator().manual_seed(0)) < 0.5
    attn = keys if keys is not None else dense
    return parse_mask(None if attn is None else attn.to(device), dense is None, b, HQ, case.T, case.S, device,
                      window=case.window, document_ids=None if docs is None else docs.to(device), varlen=varlen,
                      key_runs=runs)


@contextlib.contextmanager
def _platform_assumed(device_type: str) -> Iterator[None]:
    """Backends answer as on a machine whose platform checks pass (CUDA present, kernels built, triton), unless this
    machine has the device: then the checks run for real."""
    real = device_type == "cuda" and torch.cuda.is_available()
    modules = {sys.modules[type(b).__module__] for b in backends.BACKENDS}
    saved = {m: m._platform_reason for m in modules if hasattr(m, "_platform_reason")}
    try:
        if not real:
            for m in saved:
                m._platform_reason = lambda: None
        yield
    finally:
        for m, f in saved.items():
            m._platform_reason = f


class Row(NamedTuple):
    mask: str
    lse: bool  # the kernel is asked for a log-sum-exp (sink-like variants)
    served_by: str
    refused: list[tuple[str, str]]  # (backend, why) of every backend asked before it


def dispatch_table(device_type: str = "cuda", dtype: torch.dtype = torch.bfloat16, mode: str = "eager",
                   cases: list[Case] | None = None) -> list[Row]:
    """Which backend serves each case in `mode` (one of MODES), for calls that need no lse and for calls that do, as
    the automatic choice decides it (backends.explain) for a training call (requires_grad), B = 2, Hq/Hkv = 8/2,
    D = 128."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    device_type = device_type_of(device_type)
    rows = []
    with _platform_assumed(device_type):
        for case in cases or CASES:
            mask = _mask(case, mode)
            for lse in (False, True):
                score = make_score(None, case.softcap, D)
                call = Call(device_type, dtype, case.batch, HQ, HKV, case.T, case.S, D, mask, lse, True, score)
                steps = backends.explain(call)
                served = steps[-1][0] if steps[-1][1] is None else "none"
                rows.append(Row(case.name, lse, served, [(n, r) for n, r in steps if r is not None]))
    return rows


def markdown(rows: list[Row], variants_without_lse: str, variants_with_lse: str) -> str:
    """rows as a markdown table; the variants columns name which variants ask for a call of each kind."""
    out = ["| mask | variants | served by | refused before it |", "|---|---|---|---|"]
    for r in rows:
        refused = "; ".join(f"`{n}`: {why}" for n, why in r.refused) or "—"
        out.append(f"| {r.mask} | {variants_with_lse if r.lse else variants_without_lse} | `{r.served_by}` | "
                   f"{refused.replace('|', '/')} |")
    return "\n".join(out)
