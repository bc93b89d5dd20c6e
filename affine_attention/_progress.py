"""Progress of long command-line steps, on stderr: a tqdm bar on a terminal, plain lines elsewhere (logs, CI, pipes),
so a step of tens of seconds is never silent and captured output stays readable."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager

PLAIN_EVERY_S = 5.0  # without a terminal: one line at least this far apart (and the last one)


class Steps:
    """A counter of `total` steps named `desc`; `update()` after each step, `close()` at the end."""

    def __init__(self, desc: str, total: int, unit: str = "step"):
        self.desc, self.total, self.unit, self.done = desc, total, unit, 0
        self._start = self._last = time.perf_counter()
        self._bar = None
        if sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)
        else:
            self._line()

    def _line(self) -> None:
        print(f"{self.desc}: {self.done}/{self.total} {self.unit}s, {time.perf_counter() - self._start:.0f} s",
              file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        if self.done >= self.total or now - self._last >= PLAIN_EVERY_S:
            self._last = now
            self._line()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Steps:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextmanager
def phase(desc: str):
    """One step of unknown length (e.g. loading a model): a line when it starts and one with its time when done."""
    print(f"{desc} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f"{desc}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
