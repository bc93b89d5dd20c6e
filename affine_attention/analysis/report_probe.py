"""The report's "Sink mechanism" section for a run on the Bigram-Backcopy task (data.eval.kind = "backcopy"): the
measurements of analysis/sink_probe.py on every final checkpoint (mean ± std over seeds), on every kept periodic
checkpoint (a figure of how they evolve, so a reader sees when the sink forms), whether the reference variant formed a
sink, and the same numbers, machine-readable, for summary.json.

The probe's layer is the layer where the reference variant's dormant queries put the most softmax mass on BOS
relative to their uniform share (mean over seeds); every variant is read at that layer."""
from __future__ import annotations

import statistics
from pathlib import Path

from ..text.backcopy import task
from ..variants import REFERENCE
from . import sink_probe
from .analyze import load_model
from .compare_run import SeedRun
from .report_template import Figure, Heading, Para, Table

__all__ = ["probe_task", "probe_ids", "probe_data", "probe_blocks", "readable"]


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for every byte (GPT-2's table: 'Ġ' a space, 'Ċ' a newline) -> the byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


_BYTE_LEVEL = _byte_level_chars()


def readable(token: str) -> str:
    """A byte-level token as the text it stands for ('Ċ' -> '\n', 'Ġthe' -> ' the'); other strings unchanged."""
    if not token or any(ch not in _BYTE_LEVEL for ch in token):
        return token
    return bytes(_BYTE_LEVEL[ch] for ch in token).decode("utf-8", errors="replace")


def probe_task(cfg: dict):
    """The BackcopyTask of a run's config dict, or None when its held-out data is not the task."""
    data = cfg.get("data", {})
    if data.get("eval", {}).get("kind") != "backcopy":
        return None
    return task(**data.get("backcopy", {}))


def probe_ids(cfg: dict, sequences: int):
    """(sequences, seq_len + 1) int64: the first held-out task sequences, exactly those the run evaluated on."""
    return probe_task(cfg).sequences("validation", 0, range(sequences), cfg["data"]["seq_len"] + 1)


def _steps(run: SeedRun) -> list[tuple[int, Path]]:
    """(step, folder) of the run's kept periodic checkpoints and its final one, by step."""
    out = []
    for p in sorted((run.path / "checkpoints").glob("step-*")):
        if (p / "config.json").is_file():
            out.append((int(p.name.split("-")[1]), p))
    if (run.final / "config.json").is_file():
        out.append((int(run.result.get("steps") or (out[-1][0] + 1 if out else 0)), run.final))
    return sorted(set(out))


def probe_data(runs: dict[str, list[SeedRun]], cfg: dict, sequences: int) -> dict:
    """variant -> {"per_seed": {seed: measure}, "sink_formed": {seed: bool}, "mean": aggregate, "evolution":
    {step: aggregate over the seeds with that checkpoint}}, plus the probe layer and whether the reference formed a
    sink (mean over its seeds, at the probe layer)."""
    bc = probe_task(cfg)
    ids = probe_ids(cfg, sequences)
    out: dict = {"variants": {}, "sequences": sequences, "factor": sink_probe.SINK_FACTOR,
                 "triggers": [readable(bc.names[i]) for i in bc.triggers]}
    for v, rs in runs.items():
        per_seed, evo = {}, {}
        for r in rs:
            for step, path in _steps(r):
                m = sink_probe.measure(load_model(str(path))[0], ids, bc)
                evo.setdefault(step, []).append(m)
                if path == r.final:
                    per_seed[r.seed] = m
        if per_seed:
            out["variants"][v] = {"per_seed": per_seed,
                                  "sink_formed": {s: sink_probe.sink_formed(m) for s, m in per_seed.items()},
                                  "mean": sink_probe.aggregate(list(per_seed.values())),
                                  "evolution": {s: sink_probe.aggregate(ms) for s, ms in sorted(evo.items())}}
    ref = out["variants"].get(REFERENCE)
    if ref:
        layers = ref["per_seed"][min(ref["per_seed"])]["layers"]
        ratio = {L["layer"]: ref["mean"][f"L{L['layer']}.p_first.dormant"]["mean"]
                 / ref["mean"][f"L{L['layer']}.uniform_first.dormant"]["mean"] for L in layers}
        out["layer"] = max(ratio, key=ratio.get)
        out["reference_sink"] = ratio[out["layer"]] >= sink_probe.SINK_FACTOR
        out["reference_ratio"] = ratio[out["layer"]]
    else:
        out["layer"], out["reference_sink"], out["reference_ratio"] = 0, None, None
    return out


# (flat key under the probe layer or the model, column label, format)
COLUMNS = [("p_first.dormant", "p→BOS dormant", "{:.3f}"), ("w_first.dormant", "w→BOS dormant", "{:.3f}"),
           ("p_first.active", "p→BOS active", "{:.3f}"), ("w_first.active", "w→BOS active", "{:.3f}"),
           ("alpha.dormant.mean", "α dormant", "{:.3f}"), ("alpha.active.mean", "α active", "{:.3f}"),
           ("sink_share.dormant", "sink share dormant", "{:.3f}"), ("sink_share.active", "sink share active", "{:.3f}"),
           ("value_norm_ratio", "|v_BOS| / |v|", "{:.2f}"), ("residual_norm_ratio", "|h_BOS| / |h|", "{:.2f}"),
           ("@backcopy_accuracy", "backcopy acc.", "{:.3f}"), ("@bigram_loss", "bigram loss", "{:.3f}")]


def _cell(agg: dict, key: str, fmt: str) -> str:
    m = agg.get(key)
    if m is None:
        return "-"
    return fmt.format(m["mean"]) + (f" ± {fmt.format(m['std'])}" if m["std"] is not None else "")


def _key(layer: int, col: str) -> str:
    return col[1:] if col.startswith("@") else f"L{layer}.{col}"


def probe_blocks(data: dict, figdir: Path) -> list:
    """The section: a paragraph on the sink test, the table at the probe layer, the evolution figure."""
    if not data["variants"]:
        return []
    L = data["layer"]
    ref = data["variants"].get(REFERENCE)
    seeds_formed = sum(ref["sink_formed"].values()) if ref else 0
    any_v = next(iter(data["variants"].values()))
    entropy = any_v["mean"].get("bigram_entropy", {}).get("mean")
    blocks: list = [Heading("Sink mechanism (Bigram-Backcopy)")]
    if ref:
        blocks.append(Para(
            f"{REFERENCE} {'forms' if data['reference_sink'] else 'does not form'} a BOS sink at layer {L}: its "
            f"dormant queries put {data['reference_ratio']:.1f}x their uniform share of softmax mass on BOS (mean over "
            f"seeds; the criterion is {data['factor']:g}x), in {seeds_formed} of {len(ref['sink_formed'])} seeds "
            f"taken one by one. Triggers: {', '.join(repr(t) for t in data['triggers'])}."))
    names = list(data["variants"])
    # One row per measurement, one column per variant: 8 variants fit a page side by side, 12 measurements do not.
    rows = [[c] + [_cell(data["variants"][v]["mean"], _key(L, k), f) for v in names] for k, c, f in COLUMNS]
    rows = [r for r in rows if any(x != "-" for x in r[1:])]  # e.g. no alpha row in a run without affine variants
    caption = (f"Layer {L}, {data['sequences']} held-out task sequences, final checkpoints, mean ± sample std over "
               "seeds. Active queries: trigger tokens (the next token copies the previous one); dormant: every other "
               "query after BOS. p: the plain softmax over visible keys; w: the variant's effective weights (affine: "
               "α p + β; sink: the mass left to real tokens; otherwise p). |v_BOS| / |v|: BOS value-state norm over "
               "the other tokens' mean (value drain below 1); |h_BOS| / |h|: the same for the residual state after "
               "the layer. Bigram loss: cross-entropy on dormant queries")
    caption += (f" (the chain's entropy at those positions, {entropy:.3f}, is what the true chain scores in "
                "expectation)." if entropy is not None else ".")
    blocks.append(Table(["measurement"] + names, rows, caption,
                        "Table 4. The sink mechanism, by query role", wrap_columns=tuple(range(1, len(names) + 1))))
    path = _evolution_figure(data, figdir / "sink_evolution.png")
    if path is not None:
        blocks.append(Figure(path, f"Layer {L} during training (mean over seeds at each kept checkpoint): BOS mass of "
                                   "dormant and active queries (softmax part p, solid; effective weights w, dashed), "
                                   "alpha where the variant has one, and backcopy accuracy. The sink forms where "
                                   "dormant p rises."))
    return blocks


def _evolution_figure(data: dict, path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from . import style

    L = data["layer"]
    if not any(len(d["evolution"]) > 1 for d in data["variants"].values()):
        return None
    # 2 x 2 panels about as wide as the report's column (1,130 px at 1280 px), so fonts keep their size on screen.
    fig, axes = plt.subplots(2, 2, figsize=(10.5, 7.6))
    axes = axes.ravel()
    panels = [("p_first.dormant", "w_first.dormant", "BOS mass, dormant queries: p (solid), w (dashed)"),
              ("p_first.active", "w_first.active", "BOS mass, active queries: p (solid), w (dashed)"),
              ("alpha.dormant.mean", "alpha.active.mean", "α: dormant (solid), active (dashed)"),
              ("@backcopy_accuracy", None, "backcopy accuracy")]
    for ax, (solid, dashed, title) in zip(axes, panels):
        for v, d in data["variants"].items():
            steps = list(d["evolution"])
            for key, ls in ((solid, "-"), (dashed, "--")):
                if key is None:
                    continue
                vals = [d["evolution"][s].get(_key(L, key), {}).get("mean") for s in steps]
                pts = [(s, y) for s, y in zip(steps, vals) if y is not None]
                if pts:
                    ax.plot(*zip(*pts), ls, color=style.color(v), marker=style.marker(v), ms=3,
                            label=style.label(v) if ls == "-" else None)
        ax.set_title(title, fontsize=12)
        ax.set_xlabel("step", fontsize=11)
        ax.tick_params(labelsize=10)
        ax.grid(alpha=0.3)
    uni = statistics.fmean(d["mean"][f"L{L}.uniform_first.dormant"]["mean"] for d in data["variants"].values())
    axes[0].axhline(data["factor"] * uni, color="#777", lw=0.8, ls=":")
    axes[0].text(0.01, data["factor"] * uni, f" {data['factor']:g}x uniform", color="#555", fontsize=10,
                 transform=axes[0].get_yaxis_transform(), va="bottom")
    # One legend below the panels: inside a panel it would hide the curves it names.
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(4, len(data["variants"])),
               fontsize=11, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_record(data: dict) -> dict:
    """What summary.json keeps: per variant the per-seed flags and every measurement's mean, std and values."""
    return {"layer": data["layer"], "reference_sink": data["reference_sink"],
            "reference_ratio": data["reference_ratio"], "factor": data["factor"], "triggers": data["triggers"],
            "variants": {v: {"sink_formed": d["sink_formed"], "mean": d["mean"],
                             "evolution": {str(s): {k: a["mean"] for k, a in agg.items()}
                                           for s, agg in d["evolution"].items()}}
                         for v, d in data["variants"].items()}}
