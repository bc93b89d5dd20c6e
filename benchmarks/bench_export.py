"""Peak host memory of writing a run's final/ from its sharded (DCP) step checkpoint: the model built whole in fp32 and
saved (`load_sharded_model(...).save_pretrained`, how export worked before) against the streamed export
(`hf.sharded.write_pretrained`, one weights file at a time), on a ~0.75 GB fp32 model trained one step. Each export
runs in a fresh process; measured = peak RSS (ru_maxrss) and that minus the RSS once the libraries are imported, with
a fixed glibc mmap threshold (benchmarks/bench_dryrun.py says why), and the export's wall time (one run each, on a
shared machine: a rough figure). The outputs' tensors are compared.

    python benchmarks/bench_export.py [--workdir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# 12 Llama layers of width 1024 (4096 MLP, 4 KV heads) on the packaged 4096-token vocabulary: ~0.19B parameters.
MODEL = ["model.hidden_size=1024", "model.intermediate_size=4096", "model.num_layers=12", "model.num_heads=16",
         "model.num_kv_heads=4", "data.seq_len=32", "train.global_batch=2", "train.micro_batch=2", "train.steps=1",
         "train.device='cpu'", "train.precision='fp32'", "variant.name='affine'", "train.eval_every=0",
         "data.eval_sequences=2", "data.eval_batch=2", "data.probe_sequences=1"]
WAYS = {"built whole (before)": ["built"], "streamed, 2 GB files (default)": ["streamed", str(2 * 10**9)],
        "streamed, 100 MB files": ["streamed", str(10**8)]}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def child(way: str, step: str, out: str, limit: int | None) -> None:
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoTokenizer

    from affine_attention.hf.registration import register
    from affine_attention.hf.sharded import load_sharded_model
    from affine_attention.train.export import _write_sharded

    register()
    base, t0 = _rss(), time.perf_counter()
    Path(out).mkdir()
    if way == "built":
        load_sharded_model(step).save_pretrained(out)
        AutoTokenizer.from_pretrained(step).save_pretrained(out)
    else:
        _write_sharded(Path(step), Path(out), limit)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak": peak, "base": base, "seconds": time.perf_counter() - t0}))


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=None, help="where the run and the exports go (default: a temporary folder)")
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-export-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
           "HF_HUB_OFFLINE": "1"}
    run = work / "run"
    if not run.is_dir():
        subprocess.run([sys.executable, "-m", "affine_attention.cli", "train", "--config", "tiny",
                        *[a for s in MODEL for a in ("--set", s)], "--out", str(run)], env=env, check=True,
                       capture_output=True)
    step = next((run / "checkpoints").glob("step-*"))
    size = sum(f.stat().st_size for f in (step / "state").iterdir())
    print(f"step checkpoint {step} (model and optimizer shards: {size / 2**20:,.0f} MiB)")
    print(f"{'export':32s} {'peak RSS MiB':>12s} {'above imports MiB':>17s} {'files':>5s} {'wall s':>6s}")
    folders = {}
    for label, way in WAYS.items():
        out = work / f"out-{len(folders)}"
        cmd = [sys.executable, __file__, "--child", way[0], str(step), str(out), *(way[1:] or ["0"])]
        done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        res = json.loads(done.stdout.splitlines()[-1])
        files = len(list(out.glob("*.safetensors")))
        print(f"{label:32s} {res['peak'] / 2**20:12,.0f} {(res['peak'] - res['base']) / 2**20:17,.0f} {files:5d} "
              f"{res['seconds']:6.1f}")
        folders[label] = out
    weights = [_weights(f) for f in folders.values()]
    model = sum(t.numel() * t.element_size() for t in weights[0].values())
    same = all(w.keys() == weights[0].keys() and all((w[k] == weights[0][k]).all() for k in w) for w in weights[1:])
    print(f"model weights {model / 2**20:,.0f} MiB (fp32); every export holds the same tensors: {same}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]) or None)
    else:
        main()
