"""Training benchmark: (1) tokens/s of a full training step (forward, backward, clipping, AdamW) for each attention
variant in the `tiny` preset, relative to softmax; (2) the cost of a KD step with cached teacher top-k logits versus
a live teacher (SmolLM2-135M GGUF teacher, `kd-smollm2` student). Methods run interleaved in a shuffled order per
repeat, and ratios are medians of per-repeat ratios (benchmarks/common.py), so machine noise largely cancels.

    python benchmarks/bench_train.py            # full run
    python benchmarks/bench_train.py --quick    # fewer repeats, smaller KD batch
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import paired_ratios  # noqa: E402

from affine_attention.train.config_load import load_config  # noqa: E402
from affine_attention.variants.running_stats import step_running_stats  # noqa: E402

VARIANTS = ["softmax", "off_by_one", "sink", "gated", "affine", "affine_gated"]


def _step_fn(model, batch, loss_fn):
    """One optimizer step on batch (B, T + 1); loss_fn(logits, inputs, targets) -> scalar."""
    from affine_attention.train.optim import build_optimizer

    opt = build_optimizer(model, load_config("tiny").optim)
    inputs, targets = batch[:, :-1], batch[:, 1:]

    def step():
        logits = model(input_ids=inputs).logits
        loss_fn(logits, inputs, targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step_running_stats(model)  # alpha_ma's one EMA step per optimizer step (no-op without running stats)
        opt.zero_grad(set_to_none=True)
    return step


def bench_variants(repeats: int) -> str:
    from affine_attention.train.data import open_source
    from affine_attention.train.kd import ce_loss
    from affine_attention.train.model import build_base, convert
    from affine_attention.train.pretrained import load_tokenizer

    cfg = load_config("tiny")
    tok = load_tokenizer(cfg.data.tokenizer)
    batch = open_source(cfg.data.train, tok, cfg.data, 0, shuffle=True).take(cfg.train.global_batch)[0]
    base = build_base(cfg.model, 0, eos_token_id=tok.eos_token_id)
    methods = {}
    for v in VARIANTS:
        model = convert(base, v).train()
        methods[v] = _step_fn(model, batch, lambda logits, i, t: ce_loss(logits, t))
    res = paired_ratios(methods, "softmax", torch.device("cpu"), repeats=repeats, warmup=2)
    tokens = batch.shape[0] * (batch.shape[1] - 1)
    lines = [f"### Training step, tiny preset ({batch.shape[0]} x {batch.shape[1] - 1} tokens, "
             f"{torch.get_num_threads()} threads, {repeats} repeats)", "",
             "| variant | median step (ms) | tokens/s | tokens/s vs softmax |", "|---|---|---|---|"]
    for v in VARIANTS:
        r = res[v]
        lines.append(f"| {v} | {1e3 * r['median_s']:.1f} | {tokens / r['median_s']:,.0f} | {1 / r['ratio']:.3f} |")
    return "\n".join(lines)


def bench_kd(repeats: int, batch_size: int, teacher: str) -> str:
    from affine_attention.train.data import data_key, open_source
    from affine_attention.train.kd import Teacher, ce_loss, kd_loss_topk
    from affine_attention.train.model import build_base, convert
    from affine_attention.train.pretrained import load_tokenizer

    cfg = load_config("kd-smollm2", [f"kd.teacher='{teacher}'"])
    tok = load_tokenizer(cfg.data.tokenizer)
    source = open_source(cfg.data.train, tok, cfg.data, 0, shuffle=True)
    batch, ids = source.take(batch_size)
    base = build_base(cfg.model, 0, eos_token_id=tok.eos_token_id)
    cache_dir = tempfile.mkdtemp(prefix="bench_kd_cache_")

    def teacher_for(cache: bool) -> Teacher:
        kd = load_config("kd-smollm2", [f"kd.teacher='{teacher}'", f"kd.cache={'true' if cache else 'false'}",
                                        f"kd.cache_dir='{cache_dir}'"]).kd
        return Teacher(kd, student_tok=tok, student_tok_spec=cfg.data.tokenizer, student_vocab=cfg.model.vocab_size,
                       data_key=data_key(source, cfg.data.seq_len), seq_len=cfg.data.seq_len,
                       device=torch.device("cpu"))

    live, cached = teacher_for(False), teacher_for(True)
    cached._model = live.model  # one teacher in memory; the cache is filled once before timing
    cached.targets(batch[:, :-1], ids)
    cached.flush()
    cached._model = None

    def kd_loss_with(t: Teacher):
        def loss(logits, inputs, targets):
            top = t.targets(inputs, ids)
            return kd_loss_topk(logits, top["values"], top["indices"], t.cfg.temperature)
        return loss

    methods = {
        "CE only (no teacher)": _step_fn(convert(base, "affine"), batch, lambda lg, i, t: ce_loss(lg, t)),
        "KD, cached top-64": _step_fn(convert(base, "affine"), batch, kd_loss_with(cached)),
        "KD, live teacher top-64": _step_fn(convert(base, "affine"), batch, kd_loss_with(live)),
    }
    res = paired_ratios(methods, "KD, cached top-64", torch.device("cpu"), repeats=repeats, warmup=1)
    assert cached._model is None, "the cached teacher loaded its model: the cache missed"
    tokens = batch.shape[0] * cfg.data.seq_len
    lines = [f"### KD step, kd-smollm2 student, teacher {teacher} ({batch_size} x {cfg.data.seq_len} tokens, "
             f"{repeats} repeats)", "", "| step | median (ms) | tokens/s | time vs cached KD |", "|---|---|---|---|"]
    for name, r in res.items():
        lines.append(f"| {name} | {1e3 * r['median_s']:.0f} | {tokens / r['median_s']:,.0f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats and a smaller KD batch")
    p.add_argument("--skip-kd", action="store_true", help="only the variant table")
    p.add_argument("--teacher", default="smollm2-135m-instruct-gguf", help="KD teacher spec (default: SmolLM2 GGUF)")
    args = p.parse_args()
    torch.manual_seed(0)
    print(bench_variants(repeats=5 if args.quick else 20))
    if not args.skip_kd:
        print()
        print(bench_kd(repeats=2 if args.quick else 5, batch_size=2 if args.quick else 8, teacher=args.teacher))


if __name__ == "__main__":
    main()
