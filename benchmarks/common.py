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
    """Peak bytes of live tensors while fn runs, above what was allocated before it (CPU via the profiler's memory
    records, CUDA via the allocator's statistics). On the CPU this counts what torch's allocator hands out, not
    what libraries allocate themselves (e.g. MKL's matmul workspace) nor the process's resident set."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # The allocator's own records (+bytes at an allocation, -bytes at its free), replayed in time order. Not the
    # op events' cpu_memory_usage: an op's event sums the allocations inside it, so nested ops (linear > matmul > mm)
    # count one allocation once per level. A block allocated before the profiler started is not freed in them.
    records = sorted((e for e in prof.profiler.kineto_results.events()
                      if e.name() == "[memory]" and e.device_type() == DeviceType.CPU), key=lambda e: e.start_ns())
    current = peak = 0
    for e in records:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def emit(table: str, out: str | None) -> None:
    """Print a benchmark's markdown table, and write it to `out` too when given."""
    print("\n" + table)
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")
