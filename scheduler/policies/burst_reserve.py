"""The free blocks kept for arrivals (FastServe §4.2): proactive swapping
keeps as many device blocks free as the jobs expected over a short horizon
will need for their first iteration, estimated from the recent arrivals."""

from __future__ import annotations

import math
from collections import deque

# Arrivals are counted over this window and scaled to the horizon.
ARRIVAL_WINDOW_S = 10.0
RESERVE_HORIZON_S = 1.0
# Never more than this share of the device blocks.
RESERVE_CAP = 0.25


class BurstReserve:
    def __init__(self) -> None:
        self._arrivals: deque[tuple[float, int]] = deque()  # (time, first blocks)
        self._blocks = 0  # Σ of the blocks in `_arrivals`

    def arrived(self, now: float, first_blocks: int) -> None:
        self._arrivals.append((now, first_blocks))
        self._blocks += first_blocks

    def target(self, now: float, num_blocks: int) -> int:
        """Free blocks to keep: those expected over the horizon."""
        while self._arrivals and now - self._arrivals[0][0] > ARRIVAL_WINDOW_S:
            self._blocks -= self._arrivals.popleft()[1]
        if not self._arrivals:
            return 0
        window = max(now - self._arrivals[0][0], 1e-3, RESERVE_HORIZON_S)
        blocks = self._blocks * RESERVE_HORIZON_S / window
        return min(math.ceil(blocks), int(num_blocks * RESERVE_CAP))
