"""Data cost per training step at the paper's scale: one rank's reader of prepared token shards (memory-mapped, its
own 128 rows of a 1024 x 2048 global batch, 8 ranks) against today's path (tokenising the global batch on every
rank) and against a reference step time; resume cost at step 10 vs step 1,000; the global batch for world sizes
1, 2 and 4. All numbers measured in one run on a synthetic prepared corpus of random uint32 tokens (written to a
temporary folder and deleted after).

Reference step: 2.1M tokens / (8 GPUs x 28k tokens/s/GPU, a tuned trainer's throughput for the 1B student,
issue 30) = 9.4 s. The reads hit the page cache (the corpus was just written), as they do on a node whose RAM holds
the corpus; a cold first epoch reads ~1 MB per rank per step from disk in addition.

    python benchmarks/bench_data.py                        # 96M tokens (384 MB) in 8 shards
    python benchmarks/bench_data.py --tokens 200e6 --repeats 30
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from affine_attention.text import corpus_texts
from affine_attention.train.data import TOKENIZE_BATCH, TrainBatches, tokenize_documents
from affine_attention.train.pretrained import load_tokenizer, tokenizer_fingerprint
from affine_attention.train.shards import FORMAT, TokenSource, file_sha256, write_manifest, write_shard

SEQ, GLOBAL, WORLD = 2048, 1024, 8
REFERENCE_STEP_S = GLOBAL * SEQ / (WORLD * 28_000)  # 9.4 s
VOCAB = 128_256  # Llama 3's vocabulary: uint32 tokens


def synthetic_corpus(folder: Path, tokens: int, shards: int, tok) -> None:
    """A prepared folder of random uint32 tokens (valid manifest for `tok`, so TokenSource opens it)."""
    rng = np.random.default_rng(0)
    per = tokens // shards
    manifest = {"format": FORMAT, "tokenizer_fingerprint": tokenizer_fingerprint(tok), "separator_id":
                tok.eos_token_id, "source": {"kind": "synthetic"}, "dtype": "uint32", "shard_documents": per // 1000,
                "tokenizer": "default", "separator": tok.eos_token, "vocab": VOCAB, "complete": True, "shards": []}
    for k in range(shards):
        data = rng.integers(0, VOCAB, per, dtype=np.uint32)
        manifest["shards"].append(write_shard(folder, k, data, np.arange(1000, per + 1, 1000, dtype=np.int64)))
    write_manifest(folder, manifest)


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def tokenise_rate(tok, min_tokens: int = 300_000) -> float:
    """Tokens per second of today's path (data.tokenize_documents, batches of TOKENIZE_BATCH documents), on
    ~2 KB pieces of the embedded corpus (web-document sized)."""
    text = "".join(corpus_texts("train"))
    docs = [text[i:i + 2000] for i in range(0, len(text), 2000)]
    done, t0, i = 0, time.perf_counter(), 0
    while done < min_tokens:
        batch = docs[i:i + TOKENIZE_BATCH]
        done += sum(map(len, tokenize_documents(tok, batch, tok.eos_token_id)))
        i = (i + TOKENIZE_BATCH) % len(docs)
    return done / (time.perf_counter() - t0)


def resume_cost(folder: Path, tok, step: int, rank: int) -> float:
    """Seconds from nothing to this rank's first batch after a checkpoint at `step`: open the shards (manifest,
    tokenizer, sizes), hash this rank's share, set the cursor, read the batch."""
    t0 = time.perf_counter()
    source = TokenSource(folder, tok, tok.eos_token_id, SEQ, seed=0, shuffle=True)
    batches = TrainBatches(source, GLOBAL, GLOBAL // WORLD, rank, WORLD)
    batches.load_state_dict({**source.state_dict(), "position": step * GLOBAL})
    batches.next()
    dt = time.perf_counter() - t0
    batches.close()
    return dt


def global_batch(folder: Path, tok, world: int, step: int) -> torch.Tensor:
    """The ids of global batch `step`, concatenated over the ranks of a `world`-rank run in rank order."""
    parts = []
    for rank in range(world):
        source = TokenSource(folder, tok, tok.eos_token_id, SEQ, seed=0, shuffle=True)
        source.verified.update(range(len(source.maps)))  # hashed once above; this checks the order only
        batches = TrainBatches(source, GLOBAL, GLOBAL // world, rank, world)
        batches.load_state_dict({**source.state_dict(), "position": step * GLOBAL})
        parts.append(batches.next()[1])
        batches.close()
    return torch.cat(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=float, default=96e6, help="synthetic corpus size in tokens")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer("default")
    folder = Path(tempfile.mkdtemp(prefix="bench_data_"))
    try:
        t0 = time.perf_counter()
        synthetic_corpus(folder, int(args.tokens), args.shards, tok)
        size = sum(p.stat().st_size for p in folder.glob("shard-*.npy"))
        print(f"synthetic corpus: {int(args.tokens):,} uint32 tokens, {size / 1e6:.0f} MB in {args.shards} shards "
              f"({time.perf_counter() - t0:.1f} s to write)", file=sys.stderr)
        rank = 3
        source = TokenSource(folder, tok, tok.eos_token_id, SEQ, seed=0, shuffle=True)
        batches = TrainBatches(source, GLOBAL, GLOBAL // WORLD, rank, WORLD)
        read_ms = median_ms(batches._read, args.repeats)  # synchronous: what a step would wait without prefetch
        batches.close()

        def wait_with_prefetch() -> float:  # the time a step waits in next() when it computes between batches
            b = TrainBatches(TokenSource(folder, tok, tok.eos_token_id, SEQ, 0, True), GLOBAL, GLOBAL // WORLD, rank,
                             WORLD)
            b.next()
            waits = []
            for _ in range(args.repeats):
                time.sleep(0.05)  # stands for the step's compute (9.4 s in the reference)
                t = time.perf_counter()
                b.next()
                waits.append(time.perf_counter() - t)
            b.close()
            return 1e3 * statistics.median(waits)

        wait_ms = wait_with_prefetch()
        rate = tokenise_rate(tok)
        today_ms = 1e3 * GLOBAL * SEQ / rate
        t = time.perf_counter()
        file_sha256(folder / "shard-00000.npy")
        hash_rate = (folder / "shard-00000.npy").stat().st_size / (time.perf_counter() - t)
        resume = {s: statistics.median(resume_cost(folder, tok, s, rank) for _ in range(5)) for s in (10, 1000)}
        ref = {s: global_batch(folder, tok, 1, s) for s in (10, 1000)}
        same = all(torch.equal(global_batch(folder, tok, w, s), ref[s]) for w in (2, 4) for s in (10, 1000))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    per_rank_80gb = 20e9 * 4 / WORLD / hash_rate
    rows = [
        ("reference step (2.1M tokens / (8 x 28k tokens/s/GPU))", f"{REFERENCE_STEP_S * 1e3:,.0f} ms", "1"),
        ("prepared shards: one rank reads its 128 rows (no prefetch)", f"{read_ms:.2f} ms",
         f"{read_ms / 1e3 / REFERENCE_STEP_S:.2e} ({100 * read_ms / 1e3 / REFERENCE_STEP_S:.3f}% of the step)"),
        ("prepared shards: a step's wait with prefetch", f"{wait_ms:.3f} ms",
         f"{wait_ms / 1e3 / REFERENCE_STEP_S:.2e}"),
        (f"today: tokenise the global batch on every rank ({rate / 1e6:.2f}M tokens/s, packaged 4096-token BPE)",
         f"{today_ms:,.0f} ms", f"{today_ms / 1e3 / REFERENCE_STEP_S:.3f}"),
        ("resume at step 10 (open, hash this rank's share, cursor, first batch)", f"{resume[10] * 1e3:.0f} ms", "-"),
        ("resume at step 1000", f"{resume[1000] * 1e3:.0f} ms", f"{resume[1000] / resume[10]:.2f} x step 10"),
    ]
    table = "| data path (8 ranks, seq 2048 x 1024 rows) | per step | ratio to the reference step |\n|---|---|---|\n"
    table += "\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows)
    print("\n" + table)
    print(f"\nprepared read / today's tokenising: {read_ms / today_ms:.2e} (x{today_ms / read_ms:,.0f} less)")
    print(f"resume step 1000 / step 10: {resume[1000] / resume[10]:.2f} (must be <= 1.5)")
    print(f"global batch ids identical for world sizes 1, 2, 4 at steps 10 and 1000: {same}")
    print(f"sha256 {hash_rate / 1e9:.2f} GB/s here: a 20B-token uint32 corpus (80 GB) costs each of 8 ranks "
          f"{per_rank_80gb:.0f} s of hashing at the start of a run (its share of the shards)")


if __name__ == "__main__":
    main()
