"""`affine-attention analyze`: load any local causal LM (or the packaged SmolLM2 GGUF), record its attention on
held-out text with `capture.AttentionRecorder`, write metrics.json and the paper's diagnostic figures."""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from .._environment import versions
from .._progress import Steps, phase
from ..text import encode_documents
from ..variants import REFERENCE
from .capture import AttentionRecorder, LayerRecord, find_variant_modules, utilisation

__all__ = ["load_model", "read_texts", "token_windows", "record", "summarise", "write_figures", "analyze",
           "peak_memory"]


# ---------------------------------------------------------------------------------------------------------------
# model and data
# ---------------------------------------------------------------------------------------------------------------
def load_model(spec: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32, tokenizer: str | None = None):
    """(model, tokenizer, info) for a local model folder, a *.gguf file or the shorthand "smollm2" (hf.load).

    The model is put in eval mode on `device`. A model without attention-variant modules (a plain transformers
    checkpoint) is converted to the reference variant, which leaves its logits unchanged, so its attention can be
    recorded.
    """
    from ..hf import load
    from ..hf.convert import convert

    model = load.load_model(spec, dtype=dtype)
    info = load.describe(model, spec)  # before the conversion below: the architecture as saved
    try:
        find_variant_modules(model)
        converted = True
    except ValueError:
        convert(model, REFERENCE)
        converted = False
    model.to(device).eval()
    tok = load.load_tokenizer(spec if tokenizer is None else tokenizer)
    variants = sorted({m.name for _, _, m in find_variant_modules(model)})
    info = {**info, "variants": variants, "converted_checkpoint": converted}
    return model, tok, info


def read_texts(path: str | None) -> tuple[list[str], str]:
    """Documents of a file (text.file_documents: .txt, .jsonl, .parquet, ...); None -> the packaged validation
    corpus. Returns (texts, description)."""
    from ..text import documents, read_documents

    if path is None:
        return list(documents("corpus", split="validation")), "packaged validation corpus (public-domain Shakespeare)"
    if not Path(path).is_file():
        raise ValueError(f"--data {path}: no such file")
    return read_documents(path), str(path)


# Text sources analyze can read again from a run's recorded config (read_texts); any other (a synthetic task, a hub
# stream) it cannot regenerate.
_TEXT_KINDS = ("corpus", "files")
MAX_UNKNOWN_SHARE = 0.2  # above this share of unknown tokens the text is not in the model's vocabulary


def run_data(model: str) -> dict[str, Any] | None:
    """The data section of the config a checkpoint of `train` / `compare` was trained with (its trainer_state.json),
    or None for any other model."""
    state = Path(str(model)) / "trainer_state.json"
    if not state.is_file():
        return None
    return (json.loads(state.read_text()).get("config") or {}).get("data")


def data_of_run(model: str, data: str | None, length: int | None) -> tuple[str | None, int]:
    """(--data, --length) for `model`: a checkpoint of a run is analysed on that run's own held-out text at its
    trained length unless told otherwise; a run trained on data analyze cannot read again is refused with why."""
    run = run_data(model)
    if run is None:
        return data, length or 1024
    source = run.get("eval") or {}
    if data is None:
        if source.get("kind") not in _TEXT_KINDS:
            raise ValueError(f"{model} was trained on data.eval.kind = {source.get('kind')!r} (its tokenizer knows "
                             f"only that data), which analyze cannot read again: pass --data with text of that data, "
                             f"or see the run's own attention diagnostics with `affine-attention report RUN_DIR`")
        if source["kind"] == "files":
            data = source["paths"][0]
    return data, length or int(run.get("seq_len") or 1024)


def check_vocabulary(tokenizer, ids: torch.Tensor, data_desc: str) -> None:
    """Refuse text that the tokenizer mostly maps to its unknown token: its attention would mean nothing."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return
    share = float((ids == unk).double().mean())
    if share > MAX_UNKNOWN_SHARE:
        raise ValueError(f"{share:.0%} of the tokens of {data_desc} are unknown to the model's tokenizer: the text is "
                         "not in its vocabulary; pass --data in the model's own data (or --tokenizer)")


def token_windows(tokenizer, texts: Iterable[str], sequences: int, length: int) -> torch.Tensor:
    """(N, length) int64 token windows, N <= sequences, cut back to back from the token stream of `texts`.

    Each document is tokenised without special tokens and followed by the eos token (when the tokenizer has
    one), as in training; documents are read only until enough tokens exist.
    """
    if sequences < 1 or length < 2:
        raise ValueError(f"need sequences >= 1 and length >= 2, got {sequences} and {length}")
    need, stream = sequences * length, []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for text in texts:
        stream.extend(encode_documents(tokenizer, [text])[0] + eos)  # a special token's string stays text
        if len(stream) >= need:
            break
    n = min(sequences, len(stream) // length)
    if n == 0:
        raise ValueError(f"the data hold {len(stream)} tokens, fewer than one window of {length}")
    return torch.tensor(stream[: n * length], dtype=torch.long).view(n, length)


def record(model, ids: torch.Tensor, *, chunk: int = 256, batch_size: int = 1, layers=None,
           attention_mask: torch.Tensor | None = None, progress=None) -> list[LayerRecord]:
    """Run `model` over ids (N, T) in batches under an `AttentionRecorder`; returns its per-layer records.

    attention_mask: (N, T), 1 on real tokens (pad on the right). progress: optional callable(done, total)."""
    device = next(model.parameters()).device
    n = ids.shape[0]
    # Only attention matters here: skip the (T x vocab) logits where the model allows it (time and memory).
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    with torch.inference_mode(), AttentionRecorder(model, chunk=chunk, layers=layers) as rec:
        for b0 in range(0, n, batch_size):
            kw = {"input_ids": ids[b0:b0 + batch_size].to(device), "use_cache": False, **extra}
            if attention_mask is not None:
                kw["attention_mask"] = attention_mask[b0:b0 + batch_size].to(device)
            model(**kw)
            if progress is not None:
                progress(min(n, b0 + batch_size), n)
    return rec.results()


def peak_memory(device: str = "cpu") -> dict[str, Any]:
    """Peak memory so far: the process's peak resident set size (ru_maxrss: whole lifetime, so it includes
    Python, torch, the loaded model and data, not only the analysis) and, on CUDA, torch's peak allocation."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"peak_rss_mib": rss / (1024 * 1024 if sys.platform == "darwin" else 1024),
           "what": "peak resident set size of the whole process since start (ru_maxrss)"}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        out["cuda_peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


# ---------------------------------------------------------------------------------------------------------------
# numbers
# ---------------------------------------------------------------------------------------------------------------
def _list(t) -> list:
    """Tensor -> JSON-ready list with NaN as null."""
    return [None if not math.isfinite(v) else v for v in t.to(torch.float64).tolist()]


def _mean(t) -> float | None:
    v = float(torch.nanmean(t.to(torch.float64))) if t.numel() else float("nan")
    return v if math.isfinite(v) else None


def summarise(records: Sequence[LayerRecord]) -> dict[str, Any]:
    """JSON-ready per-layer, per-head numbers plus per-layer means over heads ("per_layer")."""
    util = utilisation(list(records))
    layers = []
    for r, u in zip(records, util):
        s = r.stats
        entry = {
            "index": r.index, "name": r.name, "variant": r.variant, "num_heads": r.num_heads,
            "n_queries": int(s["n_queries"][0]),
            "first_token_mass": _list(s["first_token_mass"]), "entropy": _list(s["entropy"]),
            "mean_total_mass": _list(s["mean_total_mass"]),
            "mean_total_mass_sink_excluded": _list(s["mean_total_mass_sink_excluded"]),
            "utilisation": _list(u), "qk_logit_mean": _list(r.qk_logit_mean),
            "qk_logit_abs_mean": _list(r.qk_logit_abs_mean),
            "sink_mass": _list(r.sink_mass) if r.sink_mass is not None else None,
            "alpha": None,
        }
        if r.alpha is not None:
            entry["alpha"] = {"mean": _list(r.alpha["mean"]), "std": _list(r.alpha["std"]),
                              "quantiles": {f"{lv:g}": _list(q) for lv, q in zip(r.alpha["levels"].tolist(),
                                                                                    r.alpha["quantiles"])}}
        layers.append(entry)
    per_layer = {key: [_mean(r.stats[key]) for r in records]
                 for key in ("first_token_mass", "entropy", "mean_total_mass", "mean_total_mass_sink_excluded")}
    per_layer["qk_logit_mean"] = [_mean(r.qk_logit_mean) for r in records]
    if any(r.sink_mass is not None for r in records):
        per_layer["sink_mass"] = [_mean(r.sink_mass) if r.sink_mass is not None else None for r in records]
    if any(r.alpha is not None for r in records):
        per_layer["alpha_mean"] = [_mean(r.alpha["mean"]) if r.alpha is not None else None for r in records]
    overall = {k: _mean(torch.tensor([x for x in v if x is not None], dtype=torch.float64))
               for k, v in per_layer.items()}
    return {"layers": layers, "per_layer": per_layer, "overall": overall}


# ---------------------------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------------------------
def write_figures(results: Mapping[str, Sequence[LayerRecord]], out_dir, *, layer: int | None = None,
                  prefix: str = "", title_suffix: str = "") -> dict[str, Path]:
    """The attention figures for one or more models: results maps a name (variant) -> its layer records.

    Returns {figure key: path}: first_token_mass, entropy, head_mass (unless every model has one head per layer),
    mass_histogram, attention_map and, when some model has a non-constant alpha, alpha_histogram. `layer` picks the
    attention-map layer by position (default middle).
    """
    from . import plots

    out, sfx = Path(out_dir), title_suffix
    out.mkdir(parents=True, exist_ok=True)
    figs = {}
    figs["first_token_mass"] = plots.plot_per_layer(
        {k: [r.layer_mean("first_token_mass") for r in rs] for k, rs in results.items()},
        "first-token attention weight", f"First-token attention per layer{sfx}", out / f"{prefix}first_token_mass.png")
    figs["entropy"] = plots.plot_per_layer(
        {k: [r.layer_mean("entropy") for r in rs] for k, rs in results.items()},
        "mean attention entropy (nats)", f"Attention entropy per layer{sfx}", out / f"{prefix}entropy.png")
    # Head utilisation compares heads: with one head per layer (the sink-probe models) the grid means nothing.
    if any(r.num_heads > 1 for rs in results.values() for r in rs):
        figs["head_mass"] = plots.plot_head_heatmaps(
            {k: utilisation(list(rs)) for k, rs in results.items()}, out / f"{prefix}head_mass.png",
            title=f"Head utilisation: total mass on non-first tokens, min-max normalised{sfx}")
    totals = {k: torch.cat([r.total_mass_values for r in rs if r.total_mass_values is not None] or [torch.empty(0)])
              for k, rs in results.items()}
    figs["mass_histogram"] = plots.plot_mass_histograms(
        totals, out / f"{prefix}mass_histogram.png",
        title=f"Per-query total attention mass on non-first tokens, all layers and heads{sfx}")
    n_layers = min(len(rs) for rs in results.values())
    pos = n_layers // 2 if layer is None else layer
    if not 0 <= pos < n_layers:
        raise ValueError(f"--layer {layer} is out of range: the model has {n_layers} recorded layers")
    index = next(iter(results.values()))[pos].index
    figs["attention_map"] = plots.plot_attention_map(
        {k: rs[pos].attention_map for k, rs in results.items()}, out / f"{prefix}attention_map_layer{index}.png",
        title=f"Attention weights of layer {index}, first 30 tokens, head-averaged{sfx}")
    alphas = {k: torch.cat([r.alpha["values"] for r in rs if r.alpha is not None])
              for k, rs in results.items() if any(r.alpha is not None for r in rs)}
    # A constant alpha (the affine_frozen control) is one spike that flattens every other histogram: leave it out.
    alphas = {k: a for k, a in alphas.items() if a.numel() and float(a.max() - a.min()) > 1e-6}
    if alphas:
        figs["alpha_histogram"] = plots.plot_alpha_histograms(
            alphas, out / f"{prefix}alpha_histogram.png", title=f"Distribution of α, all layers and heads{sfx}")
    return figs


# ---------------------------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------------------------
def analyze(model: str, *, data: str | None = None, sequences: int = 10, length: int | None = None,
            out: str | Path | None = None, chunk: int = 256, layer: int | None = None, batch_size: int = 1,
            device: str = "auto", tokenizer: str | None = None, prefix: str = "", quiet: bool = False) -> dict:
    """Everything `affine-attention analyze` does; returns the metrics dict that it writes to out/metrics.json.
    length None: the run's trained length for a checkpoint of `train` / `compare`, else 1024. out None:
    runs/analyze-<time> (git-ignored), never a folder in the current directory's tree by surprise."""
    data, length = data_of_run(model, data, length)
    if out is None:
        out = Path("runs") / f"analyze-{time.strftime('%Y%m%d-%H%M%S')}"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    t0 = time.perf_counter()
    with (contextlib.nullcontext() if quiet else phase(f"loading model {model}")):
        net, tok, info = load_model(model, device=device, tokenizer=tokenizer)
    t_load = time.perf_counter() - t0
    texts, data_desc = read_texts(data)
    ids = token_windows(tok, texts, sequences, length)
    check_vocabulary(tok, ids, data_desc)
    limit = getattr(net.config, "max_position_embeddings", None)
    if limit is not None and length > limit:
        raise ValueError(f"--length {length} is beyond the model's {limit} positions; pass --length {limit} or less")
    if ids.shape[0] < sequences:
        say(f"note: the data hold only {ids.shape[0]} windows of {length} tokens (asked for {sequences})")
    attention = ", ".join(info["variants"]) if info["converted_checkpoint"] else f"{REFERENCE} (unconverted)"
    say(f"recording {info['architecture']} ({attention}) on {ids.shape[0]} x {length} tokens, "
        f"chunk {chunk}, device {device}")
    t1 = time.perf_counter()
    with (contextlib.nullcontext() if quiet else Steps("recording attention", int(ids.shape[0]), "sequence")) as bar:
        records = record(net, ids, chunk=chunk, batch_size=batch_size,
                         progress=None if bar is None else (lambda done, total: bar.update(done - bar.done)))
    t_rec = time.perf_counter() - t1
    out = Path(out)
    label = info["variants"][0] if len(info["variants"]) == 1 else "model"
    figs = write_figures({label: records}, out, layer=layer, prefix=prefix, title_suffix=f" ({Path(str(model)).name})")
    mem = peak_memory(device)
    result = {
        "config": {**info, "data": data_desc, "sequences": int(ids.shape[0]), "length": length,
                   "tokens": int(ids.numel()), "chunk": chunk, "batch_size": batch_size, "device": device,
                   "dtype": str(next(net.parameters()).dtype).replace("torch.", ""), "versions": versions(),
                   "load_s": round(t_load, 2), "record_s": round(t_rec, 2), "memory": mem},
        **summarise(records),
        "figures": {k: p.name for k, p in figs.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(result, indent=1) + "\n")
    per = result["per_layer"]
    say("layer  first-token mass  entropy (nats)  total mass (non-first)")
    for i, (f, e, m) in enumerate(zip(per["first_token_mass"], per["entropy"], per["mean_total_mass"])):
        say(f"{records[i].index:5d}  {_fmt(f):>16}  {_fmt(e):>14}  {_fmt(m):>22}")
    say(f"mean over layers: first-token mass {_fmt(result['overall']['first_token_mass'])}, "
        f"entropy {_fmt(result['overall']['entropy'])} nats, QK logit {_fmt(result['overall']['qk_logit_mean'])}")
    mem_line = f"peak RSS {mem['peak_rss_mib']:.0f} MiB (whole process)"
    if "cuda_peak_allocated_mib" in mem:
        mem_line += f", CUDA peak allocated {mem['cuda_peak_allocated_mib']:.0f} MiB"
    say(f"{mem_line}; load {t_load:.1f} s, recording {t_rec:.1f} s; wrote {out / 'metrics.json'} and "
        f"{len(figs)} figures")
    return result


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4f}"
