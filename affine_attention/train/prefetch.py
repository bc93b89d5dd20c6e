"""A background thread that reads the next batches of a data source while the current step computes: a bounded
queue, a clean stop, the producer's exceptions re-raised in the consumer, and the position of the batches handed
out (not of those read ahead), so a checkpoint resumes exactly after the last batch a step used."""
from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable
from typing import Any

_POLL_S = 0.1  # how often a blocked producer looks at the stop flag


class Prefetcher:
    """Calls `produce()` ahead in a daemon thread, keeping up to `depth` results queued; `next()` returns them in
    order. `state()` is the source's state_dict taken right after each produce, so `state_dict()` is the position
    after the last batch returned by `next()` (before the first: the state when it was built or `reset`)."""

    def __init__(self, produce: Callable[[], Any], state: Callable[[], dict[str, Any]], depth: int = 2):
        self.produce, self.state, self.depth = produce, state, depth
        self._last_state = copy.deepcopy(state())
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = ("ok", self.produce(), copy.deepcopy(self.state()))
            except BaseException as err:  # handed to the consumer, which raises it where the step asked for data
                item = ("error", err, None)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if item[0] == "error":
                return

    def next(self) -> Any:
        """The next result of `produce()`; an exception raised in the thread is raised here."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="data-prefetch", daemon=True)
            self._thread.start()
        status, value, state = self._queue.get()
        if status == "error":
            self.close()
            raise value
        self._last_state = state
        return value

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._last_state)

    def close(self) -> None:
        """Stop the thread and drop what it read ahead (the source is then ahead of `state_dict()`: load that into
        it before reading on, as TrainBatches.close does)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._queue = queue.Queue(maxsize=self.depth)

    def reset(self) -> None:
        """After the source's position was set from outside (a resume): forget what was read ahead."""
        self.close()
        self._last_state = copy.deepcopy(self.state())
