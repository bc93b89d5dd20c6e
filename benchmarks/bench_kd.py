"""Memory and time of the KD loss and its backward: today's full-logits loss (`kd.kd_loss_full` on logits h @ W^T,
the teacher's logits made whole) against the chunked one (`kd_chunked.head_loss`, the teacher's logits made chunk by
chunk from its final hidden states), at vocabularies 32,000 and 128,256, float32 on the CPU.

Peak memory, two ways, each case in fresh subprocesses after one small warm-up call of the same case, above the
hidden states and weights of both models that exist before the loss; the head's weight gradient (V x H float32),
which both paths leave in .grad, is included in both:
- tensors: the peak of the bytes of live tensors over a second loss and backward, from the torch profiler's
  allocator records (`common.allocator_peak_bytes`), the same in every process;
- RSS: the growth of the process's peak resident set (VmHWM, reset just before) over its resident set just before
  the first loss and backward, with glibc returning every freed block over 128 KiB to the system at once
  (MALLOC_MMAP_THRESHOLD_), so the resident set follows the live tensors; it also holds what libraries allocate
  themselves (MKL's matmul workspace). The chunked RSS is the largest of three processes. Not getrusage's
  ru_maxrss: Linux carries the high-water mark of the memory a process execs from into it, and subprocess execs
  from the parent's (vfork), so a child's ru_maxrss is at least this benchmark's own peak so far.
Time: median of paired ratios over --repeats interleaved runs.

    python benchmarks/bench_kd.py                                   # 2048 tokens, hidden 1024, the default chunk
    python benchmarks/bench_kd.py --tokens 4096 --hidden 2048 --vocab 32000
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import allocator_peak_bytes, emit, paired_ratios  # noqa: E402

from affine_attention.train.kd import kd_loss_full  # noqa: E402
from affine_attention.train.kd_chunked import CHUNK_TOKENS, OutputHead, head_loss  # noqa: E402


def _inputs(tokens: int, hidden: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g).mul_(hidden ** -0.5).requires_grad_()  # in place: no second copy
    h_t, w_t = torch.randn(tokens, hidden, generator=g), torch.randn(vocab, hidden, generator=g).mul_(hidden ** -0.5)
    y = torch.randint(0, vocab, (tokens,), generator=g)
    return h, w, h_t, w_t, y


def _methods(h, w, h_t, w_t, y, chunk: int, temperature: float):
    def full():
        with torch.no_grad():
            teacher = h_t @ w_t.t()  # (N, V): today's live teacher hands over whole logits
        kd_loss_full(h @ w.t(), teacher, temperature).backward()
        h.grad = w.grad = None

    def chunked():
        loss, _, _ = head_loss(h, OutputHead(w), y, teacher={"hidden": h_t, "head": OutputHead(w_t)},
                               temperature=temperature, kd_alpha=1.0, chunk=chunk)
        loss.backward()
        h.grad = w.grad = None

    return {"full": full, "chunked": chunked}


def _status_bytes(key: str) -> int:
    """A memory line of /proc/self/status (kB) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def one_case(case: str, tokens: int, hidden: int, vocab: int, chunk: int) -> dict:
    """Peak bytes of one method, run in its own process: max RSS growth over a first call, live tensors over a
    second."""
    # One small call first: the library code the loss runs is mapped into the resident set on first use (file
    # pages, more of them when other processes keep the libraries in the page cache), not by the loss's tensors.
    _methods(*_inputs(64, hidden, 512), chunk, 2.0)[case]()
    h, w, h_t, w_t, y = _inputs(tokens, hidden, vocab)
    fn = _methods(h, w, h_t, w_t, y, chunk, 2.0)[case]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
    before = _status_bytes("VmRSS")
    fn()
    rss = _status_bytes("VmHWM") - before
    return {"rss": rss, "tensors": allocator_peak_bytes(fn)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    p.add_argument("--chunk", type=int, default=CHUNK_TOKENS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--case", choices=["full", "chunked"], help=argparse.SUPPRESS)  # one subprocess's case
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.case:
        print(json.dumps(one_case(a.case, a.tokens, a.hidden, a.vocab[0], a.chunk)))
        return
    lines = [f"### KD loss + backward, {a.tokens} tokens, hidden {a.hidden}, chunk {a.chunk}, float32, "
             f"{torch.get_num_threads()} threads, {a.repeats} repeats", "",
             "| vocab | full tensors (MiB) | chunked tensors (MiB) | tensors ratio | full RSS (MiB) | "
             "chunked RSS (MiB, 3 processes) | RSS ratio (largest) | time ratio (chunked / full) | "
             "loss rel. diff (float32) |", "|---|---|---|---|---|---|---|---|---|"]
    for vocab in a.vocab:
        peaks = {}
        for case, runs in (("full", 1), ("chunked", 3)):
            cmd = [sys.executable, __file__, "--case", case, "--tokens", str(a.tokens), "--hidden", str(a.hidden),
                   "--vocab", str(vocab), "--chunk", str(a.chunk)]
            # glibc returns every block over 128 KiB to the system when freed, so the resident set follows the live
            # tensors (its default, a threshold that grows to 32 MiB, keeps freed blocks resident)
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
            peaks[case] = [json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                                     env=env).stdout) for _ in range(runs)]
        h, w, h_t, w_t, y = _inputs(a.tokens, a.hidden, vocab)
        with torch.no_grad():
            ref = float(kd_loss_full(h @ w.t(), h_t @ w_t.t(), 2.0))
            got = float(head_loss(h, OutputHead(w), y, teacher={"hidden": h_t, "head": OutputHead(w_t)},
                                  temperature=2.0, chunk=a.chunk)[0])
        res = paired_ratios(_methods(h, w, h_t, w_t, y, a.chunk, 2.0), "full", torch.device("cpu"), a.repeats)
        del h, w, h_t, w_t
        mib = 2.0 ** 20
        tensors = {case: max(r["tensors"] for r in runs) for case, runs in peaks.items()}
        rss = {case: [r["rss"] for r in runs] for case, runs in peaks.items()}
        lines.append(f"| {vocab:,} | {tensors['full'] / mib:,.0f} | {tensors['chunked'] / mib:,.0f} | "
                     f"1/{tensors['full'] / tensors['chunked']:.1f} | {rss['full'][0] / mib:,.0f} | "
                     f"{', '.join(f'{r / mib:,.0f}' for r in rss['chunked'])} | "
                     f"1/{rss['full'][0] / max(rss['chunked']):.1f} | {res['chunked']['ratio']:.2f} | "
                     f"{abs(got - ref) / abs(ref):.1e} |")
    emit("\n".join(lines), a.out)


if __name__ == "__main__":
    main()
