"""Benchmark helpers: interleaved paired timing (medians of ratios to a baseline) and CPU/GPU peak memory."""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_once(fn: Callable[[], object], device: torch.device, inner: int = 1) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / inner


def paired_times(methods: dict[str, Callable[[], object]], device: torch.device, repeats: int, warmup: int = 1,
                 inner: int = 1, seed: int = 0) -> dict[str, list[float]]:
    """Run every method once per repeat in a shuffled order; per method its list of times (seconds), one per
    repeat, so that any two methods can be compared pairwise within a repeat."""
    rng = random.Random(seed)
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        order = list(methods)
        rng.shuffle(order)
        for name in order:
            times[name].append(time_once(methods[name], device, inner))
    return times


def median_ratio(times: dict[str, list[float]], name: str, baseline: str) -> float:
    """Median over repeats of time[name] / time[baseline] measured in the same repeat."""
    return statistics.median(t / b for t, b in zip(times[name], times[baseline]))


def paired_ratios(methods: dict[str, Callable[[], object]], baseline: str, device: torch.device, repeats: int,
                  warmup: int = 1, inner: int = 1, seed: int = 0) -> dict[str, dict[str, float]]:
    """Per method the median time and the median of its per-repeat ratio to the baseline (see paired_times).
    Pairing within a repeat cancels this noisy machine's slow phases."""
    times = paired_times(methods, device, repeats, warmup, inner, seed)
    return {name: {"median_s": statistics.median(ts), "ratio": median_ratio(times, name, baseline)}
            for name, ts in times.items()}


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated while fn runs, above what was allocated before it (CPU via the profiler's memory
    events, CUDA via the allocator's statistics). On the CPU an op's event sums the allocations made inside it, so an
    allocation counts once for every op that encloses it (linear > matmul > mm: 3x): the attention benchmarks' measure,
    not the bytes of live tensors (`allocator_peak_bytes`)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.cpu_memory_usage), key=lambda e: e.time_range.start)
    current = peak = 0
    for e in events:
        current += e.cpu_memory_usage
        peak = max(peak, current)
    return peak


def allocations(fn: Callable[[], object]) -> list[int]:
    """The bytes of every allocation (+) and free (-) while fn runs, in time order (profiler records, CPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [n for _, n in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                                 if e.name() == "[memory]")]


def allocator_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of the bytes of live tensors while fn runs, above what was live before it (CPU): each allocation once,
    unlike `peak_memory_bytes`. What libraries allocate themselves (MKL's matmul workspace) is not in it."""
    current = peak = 0
    for nbytes in allocations(fn):
        current += nbytes
        peak = max(peak, current)
    return peak


def emit(table: str, out: str | None) -> None:
    """Print a benchmark's markdown table, and write it to `out` too when given."""
    print("\n" + table)
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")
