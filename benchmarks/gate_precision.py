"""Relative error of every float32 gradient of the sink and affine ops against the same op in float64, at sink
logits -30..30 and at alpha - alpha_ma near 0 (issue 14, class 1), per CPU backend.

    python benchmarks/gate_precision.py          # prints the table the README's Reliability section quotes
"""
from __future__ import annotations

import torch

from affine_attention.ops import affine_scaled_attention, sink_attention

B, H, T, D = 1, 2, 8, 16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both vanish): the precision of a whole gradient tensor."""
    scale = float(b.abs().max())
    return float((a.double() - b).abs().max()) / scale if scale > 0 else float((a.double() - b).abs().max())


def _inputs(t: int = T, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, t, D, generator=g, dtype=torch.float64) for _ in range(4)]  # q, k, v, dO


def grads(fn, tensors, dtype):
    xs = [t.detach().to(dtype).requires_grad_(True) for t in tensors[:-1]]
    out = fn(*xs)
    out.backward(tensors[-1].to(dtype))
    return [x.grad for x in xs]


def sink_errors(s: float, backend: str, t: int = T) -> dict[str, float]:
    q, k, v, dO = _inputs(t)
    sinks = torch.full((H,), s, dtype=torch.float64)

    def fn(q, k, v, sinks):
        return sink_attention(q, k, v, sinks, is_causal=True, backend=backend)

    g32 = grads(fn, [q, k, v, sinks, dO], torch.float32)
    g64 = grads(fn, [q, k, v, sinks, dO], torch.float64)
    return dict(zip(("q", "k", "v", "sinks"), (rel(a, b) for a, b in zip(g32, g64))))


def affine_errors(delta: float, backend: str, t: int = T) -> dict[str, float]:
    q, k, v, dO = _inputs(t)
    alpha_ma = torch.full((H,), 0.5, dtype=torch.float64)
    alpha = (0.5 + delta) * torch.ones(B, H, t, dtype=torch.float64)

    def fn(q, k, v, alpha, alpha_ma):
        return affine_scaled_attention(q, k, v, alpha, alpha_ma, is_causal=True, backend=backend)

    g32 = grads(fn, [q, k, v, alpha, alpha_ma, dO], torch.float32)
    g64 = grads(fn, [q, k, v, alpha, alpha_ma, dO], torch.float64)
    return dict(zip(("q", "k", "v", "alpha", "alpha_ma"), (rel(a, b) for a, b in zip(g32, g64))))


SINK_LOGITS = (-30.0, -17.0, -10.0, 0.0, 10.0, 17.0, 30.0)
ALPHA_DELTAS = (0.0, 1e-7, 1e-4, 1e-2)
BACKENDS = ("exact", "cpu_flash")
LONG_T = 4096  # long rows: the mean of V over thousands of keys, a sink against a large lse


def table() -> list[str]:
    lines = ["| op | backend | at | " + "max rel. error of the float32 gradient per input |", "|---|---|---|---|"]
    for backend in BACKENDS:
        for s in SINK_LOGITS:
            e = sink_errors(s, backend)
            lines.append(f"| sink | {backend} | s = {s:g} | " + ", ".join(f"{k} {v:.1e}" for k, v in e.items()) + " |")
        for d in ALPHA_DELTAS:
            e = affine_errors(d, backend)
            lines.append(f"| affine | {backend} | alpha - alpha_ma = {d:g} | "
                         + ", ".join(f"{k} {v:.1e}" for k, v in e.items()) + " |")
        long_rows = (("sink", sink_errors(-17.0, backend, LONG_T)), ("affine", affine_errors(1e-7, backend, LONG_T)))
        for name, e in long_rows:
            at = "s = -17" if name == "sink" else "alpha - alpha_ma = 1e-07"
            lines.append(f"| {name} | {backend} | {at}, T = {LONG_T} | "
                         + ", ".join(f"{k} {v:.1e}" for k, v in e.items()) + " |")
    return lines


if __name__ == "__main__":
    print("\n".join(table()))
