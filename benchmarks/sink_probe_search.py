"""Search for the smallest Bigram-Backcopy setting in which plain softmax forms a BOS sink (docs/studies.md).

Each candidate is the sink-probe preset with `--set` overrides; it trains the given variants for `--seeds` seeds
(one thread each, as the machine is shared) and prints, per seed, the dormant queries' first-token softmax mass in
units of their uniform share (the probe's sink criterion: >= 3), the active (trigger) queries' share, backcopy
accuracy, bigram loss against the chain's entropy, and the wall time of the run. Nothing is asserted: timings are
measurements of this machine under its current load (printed with them).

  python benchmarks/sink_probe_search.py --seeds 3 --set train.steps=300 --set model.hidden_size=32
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--variants", default="softmax")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    from affine_attention.analysis.analyze import load_model
    from affine_attention.analysis.sink_probe import measure, sink_formed
    from affine_attention.train.compare import compare
    from affine_attention.train.config_load import load_config
    from affine_attention.train.data import eval_sequences
    from affine_attention.train.data_backcopy import task_of as task

    variants = args.variants.split(",")
    cfg = load_config("sink-probe", args.overrides + [f"compare.variants={variants!r}", "train.threads=1"])
    bc_task = task(cfg.data.backcopy)
    ids = eval_sequences(cfg.data.eval, None, cfg.data, 64)
    print(f"# {' '.join(args.overrides) or '(preset)'}; load {open('/proc/loadavg').read().split()[:3]}")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        summary = compare(cfg, Path(tmp), seeds=args.seeds, log=lambda m: None)
        wall = time.time() - t0
        formed = 0
        for v in variants:
            for k in range(args.seeds):
                model, _, _ = load_model(str(Path(tmp) / v / f"seed{k}" / "final"))
                m = measure(model, ids, bc_task)
                L = max(m["layers"], key=lambda r: r["p_first"]["dormant"] / r["uniform_first"]["dormant"])
                ratio = L["p_first"]["dormant"] / L["uniform_first"]["dormant"]
                formed += v == variants[0] and sink_formed(m)
                print(f"{v:>14} seed {k}: layer {L['layer']} dormant p_first {L['p_first']['dormant']:.3f} "
                      f"({ratio:.1f}x uniform), active {L['p_first']['active']:.3f}, w_first dormant "
                      f"{L['w_first']['dormant']:.3f}; backcopy acc {m['backcopy_accuracy']:.3f}, bigram loss "
                      f"{m['bigram_loss']:.3f} (entropy {m['bigram_entropy']:.3f}); "
                      f"run {summary['variants'][v]['wall_time_s']['values'][k]:.1f} s")
        print(f"# {variants[0]} sink in {formed}/{args.seeds} seeds; {len(variants) * args.seeds} runs in {wall:.0f} s "
              f"(threads 1, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}); "
              f"load {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
