"""The host tier's measured copy rate, in KV blocks per second.

ConServe §4.5 bounds the checkpoint copies of an iteration by what the link
moves while the iteration computes, so that they stay off its critical
path.  The rate is measured here, not configured: copies to the tier are
timed from submission to completion, and each busy period (from the first
copy in flight to the last one done) gives a sample, blocks over seconds,
so copies queued behind one another are not counted twice.
"""

from __future__ import annotations

import threading
import time

# Weight of the newest busy period in the running estimate.
SMOOTHING = 0.3


class CopyRate:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        self._blocks = 0  # finished in the current busy period
        self.rate: float | None = None  # None until one busy period ended

    def started(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
                self._blocks = 0
            self._in_flight += 1

    def finished(self, num_blocks: int) -> None:
        """A copy of `num_blocks` blocks completed (any thread)."""
        with self._lock:
            self._in_flight -= 1
            self._blocks += num_blocks
            if self._in_flight:
                return
            busy = time.perf_counter() - self._busy_since
            if busy <= 0.0 or not self._blocks:
                return
            sample = self._blocks / busy
            self.rate = sample if self.rate is None else (
                SMOOTHING * sample + (1.0 - SMOOTHING) * self.rate)
