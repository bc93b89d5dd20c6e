"""`affine-attention params` (the parameter overhead of every variant on the presets) and `affine-attention families`
(which model families and variants convert, and what is refused and why); cheap to import."""
from __future__ import annotations

import argparse


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 50_000 else f"{n:,}"


def overhead_table(presets: list[str], variants: list[str]) -> str:
    """Markdown table: one row per preset, its base size and each variant's added parameters."""
    from .._progress import Steps
    from .presets import parameter_overheads

    lines = ["| preset | base params | " + " | ".join(variants) + " |",
             "|---|---:|" + "---:|" * len(variants)]
    with Steps("building models on the meta device", len(presets) * len(variants), unit="model") as steps:
        rows = [(preset, *parameter_overheads(preset, variants, done=steps.update)) for preset in presets]
    for preset, base, extra in rows:
        lines.append(f"| {preset} | {base / 1e6:,.1f}M | " + " | ".join(_millions(extra[v]) for v in variants) + " |")
    return "\n".join(lines)


def _params(args: argparse.Namespace) -> int:
    from ..variants import variant_names
    from .presets import PAPER_PRESETS, PRESETS

    presets = args.preset or list(PAPER_PRESETS)
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        raise ValueError(f"unknown preset(s) {unknown}; choose from {sorted(PRESETS)}")
    variants = args.variant or variant_names()
    bad = [v for v in variants if v not in variant_names()]
    if bad:
        raise ValueError(f"unknown variant(s) {bad}; choose from {variant_names()}")
    print(overhead_table(presets, variants))
    return 0


def families_table() -> str:
    """Markdown: one row per core family of the table (Family.core), one column per variant ("yes"; "yes, no retrofit"
    where function_preserving=True is refused; "no [n]" with reason n below), then the family's attention and PEFT
    facts; last, the enumeration's one-line summary (docs/families.md has every family)."""
    from ..variants import get_variant, variant_names
    from .families import FAMILIES, refusal
    from .family_docs import summary

    variants = variant_names()
    reasons: list[str] = []

    def note(text: str) -> str:
        if text not in reasons:
            reasons.append(text)
        return f"[{reasons.index(text) + 1}]"

    def cell(family: str, variant: str) -> str:
        why = refusal(family, variant)
        if why:
            return f"no {note(why)}"
        never = get_variant(variant).retrofit_refusal
        return f"yes, no retrofit {note(never)}" if never else "yes"

    lines = ["| family (transformers class) | " + " | ".join(variants) + " | attention function receives | "
             "q/k/v projections | PEFT targets |", "|---|" + "---|" * (len(variants) + 3)]
    for f in (f for f in FAMILIES.values() if f.core):
        cells = " | ".join(cell(f.name, v) for v in variants)
        lines.append(f"| {f.name} ({f.model_class}) | {cells} | {f.attention} | {f.projections} | "
                     f"{', '.join(f.peft_targets)} |")
    lines += [""] + [f"[{i}] {text}" for i, text in enumerate(reasons, 1)] + ["", summary()]
    return "\n".join(lines)


def _families(args: argparse.Namespace) -> int:
    from .family_docs import families_markdown, survey_report

    if args.survey:
        text, disagree = survey_report()
        print(text)
        return int(disagree > 0)
    print(families_markdown() if args.all else families_table(), end="\n" if not args.all else "")
    return 0


def add_commands(subparsers) -> None:
    f = subparsers.add_parser("families", help="which transformers model families and variants convert",
                              description="Print a markdown table: every supported model family (the family table, "
                                          "affine_attention/hf/families.py) x every variant, what is refused and "
                                          "why, and what each family's attention receives.")
    f.add_argument("--all", action="store_true", help="every family enumerated from transformers, exact or refused "
                   "with its reason (docs/families.md)")
    f.add_argument("--survey", action="store_true", help="check every candidate family of the installed "
                   "transformers now (a tiny model each, minutes) and compare with the records")
    f.set_defaults(func=_families)

    p = subparsers.add_parser("params", help="parameters each attention variant adds to a model preset",
                              description="Print a markdown table of the trainable parameters each variant adds "
                                          "(built on the meta device, no download).")
    from ..variants import variant_names
    from .presets import PAPER_PRESETS, PRESETS

    p.add_argument("--preset", action="append", metavar="P",
                   help=f"preset name, repeatable: {', '.join(PRESETS)} (default: {', '.join(PAPER_PRESETS)})")
    p.add_argument("--variant", action="append", metavar="V",
                   help=f"variant name, repeatable: {', '.join(variant_names())} (default: all)")
    p.set_defaults(func=_params)
