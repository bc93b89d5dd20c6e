"""gpu_session's measurements, one function per kind of group, each run in a fresh worker process by
gpu_check_worker's machinery: the attention ops against raw flash (S1), a converted 1B-class Llama's training steps
eager and per-block compiled (S3), and flex forced (S4). Rows are recorded as soon as each is known.

torch is imported inside the functions (the worker machinery's rule: the standard library only at import time).
"""
from __future__ import annotations

import math
import statistics
import time

from gpu_check_models import served_backends
from gpu_check_worker import (
    fmt, guarded, inject, make_case, paired_times, peak_mib, references, served_by, step, timer, variants,
)

KERNEL_COLUMNS = ["T", "B", "mask", "row", "backend", "compile s (fwd / fwd+bwd)", "fwd ms", "fwd / raw",
                  "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd / raw", "fwd+bwd TFLOP/s", "peak MiB fwd+bwd",
                  "err out vs float64"]
LLAMA_COLUMNS = ["mode", "variant", "backends", "step ms", "step / unconverted", "tokens/s", "MFU",
                 "peak MiB (step)", "compile s", "loss", "loss compiled / eager", "q_proj grad norm c/e",
                 "v_proj grad norm c/e", "alpha_proj grad norm c/e", "check"]
NO_CUDA = "not run (no CUDA)"
LLAMA_VARIANTS = ("unconverted", "affine", "sink")
GRAD_KEYS = ("q_proj", "v_proj", "alpha_proj")
# Compiled against eager on one batch: a lost gradient term shows as a norm ratio far from 1 (or 0); bf16 reordering
# stays within a few percent.
GRAD_TOL, LOSS_TOL = 0.1, 0.02
# Dense bf16 tensor-core peaks (FLOP/s) for MFU, by the device name's words, most specific first.
PEAKS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12))


def causal_flops(lengths, Hq: int, D: int) -> float:
    """Forward FLOPs of causal attention over sequences of `lengths` (two matmuls of 2 FLOPs per multiply-add, over
    the visible half of each T x T square); fwd+bwd counts 3.5x this (FlashAttention's convention)."""
    return sum(4.0 * Hq * D * n * (n + 1) / 2 for n in lengths)


def tflops(flops: float, seconds: float) -> str:
    return fmt(flops / seconds / 1e12, ".3g")  # 3 digits: the CPU dry run's tiny sizes reach only 1e-3


def raw_sdpa_flash(t, kw, backend=None):
    """torch SDPA restricted to its FLASH backend: q (B, Hq, T, D), k, v (B, Hkv, T, D), causal, native GQA."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=True, enable_gqa=True)


def varlen_pack(x, lengths):
    """x: (B, H, T, D) -> (sum(lengths), H, D): each row's first lengths[b] positions, as the varlen kernels read."""
    import torch

    return torch.cat([x[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])


def raw_varlen_flash(q, k, v, lengths, backward: bool):
    """FA2's varlen kernels called directly (torch.ops.aten._flash_attention_forward / _backward with cumulative
    lengths): q: (total, Hq, D), k, v: (total, Hkv, D), packed rows of `lengths`, causal. Returns the forward's
    out (total, Hq, D), or the backward's (dq, dk, dv) for dout = out."""
    import torch

    aten = torch.ops.aten
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(q.device)
    n, scale = max(lengths), q.shape[-1] ** -0.5
    with torch.no_grad():  # the backward kernel is called by hand: no autograd graph around the raw kernels
        out, lse, rng, unused, _ = aten._flash_attention_forward(q, k, v, cu, cu, n, n, 0.0, True, False, scale=scale)
        if not backward:
            return out
        return aten._flash_attention_backward(out, q, k, v, out, lse, cu, cu, n, n, 0.0, True, rng, unused,
                                              scale=scale)


def slice_error(out, ref_fn, t, kw, rows: int) -> float:
    """max |out - float64| / max |float64| on batch row 0, one group of query heads and its key head, the last `rows`
    queries (bottom-right causal: they see the same keys as in the full call); out: (B, Hq, T, D) of the full call."""
    import torch

    G = t["q"].shape[1] // t["k"].shape[1]
    s = {"q": t["q"][:1, :G, -rows:], "k": t["k"][:1, :1], "v": t["v"][:1, :1], "sinks": t["sinks"][:G],
         "alpha": t["alpha"][:1, :G, -rows:], "alpha_ma": t["alpha_ma"][:G]}
    s = {n: x.detach().double() for n, x in s.items()}
    small_kw = {n: (x[:1] if torch.is_tensor(x) else x) for n, x in kw.items()}
    ref = ref_fn(s, small_kw)
    got = out[:1, :G, -rows:].double()
    return ((got - ref).abs().max() / ref.abs().max()).item()


def isolation_off(fn):
    """fn(t, kw, backend) run without the non-finite rule (ops/nonfinite.py), as bench_isolation's "off" path."""
    from bench_isolation import rule

    def off(t, kw, backend):
        with rule("off"):
            return fn(t, kw, backend)
    return off


def kernel_rows(args, rec, device, job: dict) -> None:
    """S1: one T, causal (raw SDPA-flash = 1.00, then softmax / sink / affine, automatic backend and forced
    cuda_flash) or right-padded (raw varlen FA2 = 1.00, then the ops' automatic choice), and softmax with the
    non-finite rule switched off: times, TFLOP/s, peak memory, the float64 error on a slice."""
    import torch

    T, padded, gid = job["T"], job["mask"] == "padded", job["id"]
    inject(args, gid, None, device)
    (Hq, Hkv), D, B = args.heads[0], args.head_dim, max(1, args.tokens // T)
    t, kw = make_case(B, Hq, Hkv, T, D, job["mask"], None, device, torch.bfloat16)
    for n in ("q", "k", "v", "sinks", "alpha"):
        t[n].requires_grad_()
    lengths = [T] * B if not padded else kw["attn_mask"].reshape(B, T).sum(1).tolist()
    flops = causal_flops(lengths, Hq, D)
    vs, refs, cuda = variants(), references(), device.type == "cuda"
    raw = "raw varlen FA2" if padded else "raw SDPA-flash"
    rows = {}  # label -> (fn(t, kw, backend), backend, leaves besides q, k, v, reference)
    if not padded:
        rows[raw] = (raw_sdpa_flash, None, (), refs["softmax"])
    for name, (fn, extras) in vs.items():
        for backend in (None,) if padded else (None, "cuda_flash"):
            rows[f"{name} ({backend or 'auto'})"] = (fn, backend, extras, refs[name])
    # Item 4 of issue 42: what the non-finite guarantee costs, as softmax with it (the row above) against the same
    # call without it and against raw.
    rows["softmax (auto), isolation off"] = (isolation_off(vs["softmax"][0]), None, (), refs["softmax"])
    key = {"T": str(T), "B": str(B), "mask": "right-padded" if padded else "causal"}
    for label in [r for r, (_, be, _, _) in rows.items() if be == "cuda_flash" and not cuda]:
        rec.put(table="kernels", row=dict(key, row=label, backend=NO_CUDA))
        del rows[label]
    methods = {(label, bwd): step(fn, t, kw, be, extras, bwd) for label, (fn, be, extras, _) in rows.items()
               for bwd in (False, True)}
    if padded and cuda:
        packed = [varlen_pack(t[n].detach(), lengths) for n in ("q", "k", "v")]
        for bwd in (False, True):
            methods[(raw, bwd)] = (lambda bwd=bwd: raw_varlen_flash(*packed, lengths, bwd))
    elif padded:
        rec.put(table="kernels", row=dict(key, row=raw, backend=NO_CUDA))
    base = raw if (raw, False) in methods else next(iter(rows))
    timed = {bwd: paired_times({label: fn for (label, b), fn in methods.items() if b == bwd}, base, device,
                               args.repeats, args.warmup) for bwd in (False, True)}
    rows_of = ([raw] if (raw, False) in methods and raw not in rows else []) + list(rows)
    for label in rows_of:
        def row(label=label):
            inject(args, gid, label, device)
            cells = dict(key, row=label)
            if label in rows:
                fn, be, extras, ref_fn = rows[label]
                cells["backend"] = ("sdpa (FLASH only)" if fn is raw_sdpa_flash else
                                    served_by(t, kw, label.startswith("sink"), be))
                with torch.no_grad():
                    out = fn(t, kw, be)
                cells["err out vs float64"] = fmt(slice_error(out, ref_fn, t, kw, args.error_rows), ".1e")
            else:
                cells["backend"] = "aten._flash_attention_forward/_backward (cum_seq)"
            for bwd, name, factor in ((False, "fwd", 1.0), (True, "fwd+bwd", 3.5)):
                secs, ratio = timed[bwd][label]
                cells.update({f"{name} ms": fmt(secs * 1e3, ".3f"), f"{name} TFLOP/s": tflops(flops * factor, secs),
                              f"{name} / raw": fmt(ratio, ".3f") if base == raw else NO_CUDA})
            cells["peak MiB fwd+bwd"] = fmt(peak_mib(methods[(label, True)], device), ".0f")
            yield cells
        guarded(rec, device, "kernels", dict(key, row=label), row)


def flex_rows(args, rec, device, job: dict) -> None:
    """S4: softmax and sink forced onto flex at one T (causal), compile seconds of the first forward and the first
    forward+backward, then times against S1's raw SDPA-flash at the same T (job["raw"], measured there)."""
    import torch

    T, gid = job["T"], job["id"]
    inject(args, gid, None, device)
    (Hq, Hkv), D, B = args.heads[0], args.head_dim, max(1, args.tokens // T)
    key = {"T": str(T), "B": str(B), "mask": "causal"}
    vs, refs = variants(), references()
    if device.type != "cuda":
        for name in ("softmax", "sink"):
            rec.put(table="flex", row=dict(key, row=f"{name} (flex)", backend=NO_CUDA))
        return
    t, kw = make_case(B, Hq, Hkv, T, D, "causal", None, device, torch.bfloat16)
    for n in ("q", "k", "v", "sinks"):
        t[n].requires_grad_()
    raw, measure, flops = job.get("raw") or {}, timer(device), causal_flops([T] * B, Hq, D)
    for name in ("softmax", "sink"):
        def row(name=name):
            inject(args, gid, name, device)
            fn, extras = vs[name]
            fwd, fb = step(fn, t, kw, "flex", extras, False), step(fn, t, kw, "flex", extras, True)
            compile_s = (measure(fwd), measure(fb))  # the first calls trace and compile
            times = {bwd: paired_times({name: f}, name, device, args.repeats, args.warmup)[name][0]
                     for bwd, f in ((False, fwd), (True, fb))}
            with torch.no_grad():
                out = fn(t, kw, "flex")
            cells = dict(key, row=f"{name} (flex)", backend=served_by(t, kw, name == "sink", "flex"),
                         **{"compile s (fwd / fwd+bwd)": f"{compile_s[0]:.1f} / {compile_s[1]:.1f}",
                            "err out vs float64": fmt(slice_error(out, refs[name], t, kw, args.error_rows), ".1e"),
                            "peak MiB fwd+bwd": fmt(peak_mib(fb, device), ".0f")})
            for bwd, label, factor in ((False, "fwd", 1.0), (True, "fwd+bwd", 3.5)):
                base = raw.get(f"{label} ms")
                cells.update({f"{label} ms": fmt(times[bwd] * 1e3, ".3f"),
                              f"{label} TFLOP/s": tflops(flops * factor, times[bwd]),
                              f"{label} / raw": (fmt(times[bwd] * 1e3 / float(base), ".3f") if base else
                                                 "— (S1's raw SDPA-flash not measured)")})
            yield cells
        guarded(rec, device, "flex", dict(key, row=f"{name} (flex)"), row)


def loss_and_norms(run, model, batch) -> tuple[float, dict]:
    """One forward + backward of the loss: (loss, {q_proj | v_proj | alpha_proj: the gradient norm over every layer,
    or None where the model has none}); the gradients are then dropped."""
    import torch

    loss = run(use_cache=False, **batch).loss
    loss.backward()
    norms = {}
    for k in GRAD_KEYS:
        grads = [p.grad.double().pow(2).sum() for n, p in model.named_parameters() if f".{k}." in n
                 and p.grad is not None]
        norms[k] = torch.stack(grads).sum().sqrt().item() if grads else None
    model.zero_grad(set_to_none=True)
    return loss.item(), norms


def compare(eager: tuple[float, dict], compiled: tuple[float, dict]) -> tuple[dict, str]:
    """The compiled-over-eager cells of one batch and the check: "ok", or FAIL naming each gradient that is zero,
    non-finite or off by more than GRAD_TOL (and a loss off by more than LOSS_TOL)."""
    cells, bad = {"loss compiled / eager": fmt(compiled[0] / eager[0], ".4f")}, []
    if not math.isfinite(compiled[0]) or abs(compiled[0] / eager[0] - 1) > LOSS_TOL:
        bad.append(f"loss {compiled[0]:.4g} vs eager {eager[0]:.4g}")
    for k in GRAD_KEYS:
        e, c = eager[1][k], compiled[1][k]
        if e is None:
            cells[f"{k} grad norm c/e"] = "—"
            continue
        ratio = c / e if e else math.nan
        cells[f"{k} grad norm c/e"] = fmt(ratio, ".4f")
        if not math.isfinite(c) or c == 0 or not abs(ratio - 1) <= GRAD_TOL:
            bad.append(f"{k} gradient norm {c:.3g} compiled vs {e:.3g} eager")
    return cells, ("FAIL: " + "; ".join(bad)) if bad else "ok"


def llama_rows(args, rec, device, job: dict) -> None:
    """S3: a 1B-class Llama (random weights; Llama-3.2-1B's shape, or tiny-llama on the dry run) unconverted, affine
    and sink: eager training steps (loss forward + backward, no optimizer) first, then each variant's decoder blocks
    compiled in place (fullgraph), its loss and gradient norms checked against eager on the same batch.
    MFU counts 6 FLOPs per token per weight of every matmul, plus causal attention's 6 * T * Hq * head_dim per token
    and layer (its T x T half-square, forward and backward)."""
    import torch

    import affine_attention
    from affine_attention.hf.presets import build_model
    from affine_attention.train.blocks import compile_blocks
    from torch._dynamo.utils import counters

    inject(args, job["id"], None, device)
    cuda = device.type == "cuda"
    preset, B, T = ("llama-3.2-1b", 4, 2048) if not args.quick else ("tiny-llama", 2, 32)
    models = {}
    for v in LLAMA_VARIANTS:
        torch.manual_seed(0)
        model = build_model(preset, device=str(device), dtype=torch.bfloat16 if cuda else torch.float32).train()
        models[v] = affine_attention.convert(model, v) if v != "unconverted" else model
    cfg = models["unconverted"].config
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"input_ids": ids, "labels": ids}
    matmul = sum(m.weight.numel() for m in models["unconverted"].modules() if isinstance(m, torch.nn.Linear))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    flops = 6.0 * B * T * (matmul + cfg.num_hidden_layers * T * cfg.num_attention_heads * head_dim)
    name = torch.cuda.get_device_name() if cuda else ""
    peak = next((p for words, p in PEAKS if words in name), None)

    def steps_of(run, model):
        def one():
            run(use_cache=False, **batch).loss.backward()
            model.zero_grad(set_to_none=True)
        return one

    def cells_of(mode, v, secs, base_secs, one):
        return {"mode": mode, "variant": v, "step ms": fmt(secs * 1e3, ".4g"),
                "step / unconverted": fmt(secs / base_secs, ".3f") if base_secs else "—",
                "tokens/s": fmt(B * T / secs, ".0f"),
                "MFU": (fmt(flops / secs / peak, ".1%") if peak else f"— (peak of {name!r} not known)") if cuda
                else NO_CUDA, "peak MiB (step)": fmt(peak_mib(one, device), ".0f")}

    eager = {v: loss_and_norms(m, m, batch) for v, m in models.items()}
    one = {v: steps_of(m, m) for v, m in models.items()}
    times = paired_times(one, "unconverted", device, args.model_repeats, args.warmup)
    for v in LLAMA_VARIANTS:
        def row(v=v):
            served = served_backends(one[v]) if v != "unconverted" else "transformers"
            yield dict(cells_of("eager", v, times[v][0], times["unconverted"][0], one[v]), backends=served,
                       loss=fmt(eager[v][0], ".4f"))
        guarded(rec, device, "llama", {"mode": "eager", "variant": v}, row)
    measure, compiled_base = timer(device), None
    for v in LLAMA_VARIANTS:
        def row(v=v):
            nonlocal compiled_base
            model = models[v]
            compile_blocks(model, backend="inductor" if cuda else "aot_eager")  # the dry run: no C++ compile
            graphs = counters["stats"]["unique_graphs"]
            t0, got = time.perf_counter(), {}
            # The first call traces and compiles every block (the compile seconds); the dispatcher runs only then.
            served = served_backends(lambda: got.update(r=loss_and_norms(model, model, batch)))
            if cuda:
                torch.cuda.synchronize()
            compile_s, got = time.perf_counter() - t0, got["r"]
            graphs = counters["stats"]["unique_graphs"] - graphs  # more than one per block kind: recompiles
            checks, verdict = compare(eager[v], got)
            if verdict != "ok":  # loudly: in the row, the worker's output and the run's log
                print(f"S3 compiled {v}: {verdict}", flush=True)
                rec.put(note=f"S3 compiled {v}: {verdict}")
            f = steps_of(model, model)
            f()
            secs = statistics.median(measure(f) for _ in range(args.model_repeats))
            compiled_base = secs if v == "unconverted" else compiled_base
            served = served if v != "unconverted" else "transformers"
            yield dict(cells_of("compiled (per block)", v, secs, compiled_base, f), backends=served,
                       loss=fmt(got[0], ".4f"), check=verdict, **checks,
                       **{"compile s": f"{compile_s:.1f} ({graphs} graphs)"})
        guarded(rec, device, "llama", {"mode": "compiled (per block)", "variant": v}, row)
