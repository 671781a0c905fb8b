"""The replica's start-up heap, kept out of the garbage collector's scans.

After start-up an Engine replica's process holds a few hundred thousand
long-lived objects (torch, transformers, the tokenizer, the model's modules,
Ray's and Serve's own) that never become garbage.  Every collection of the
oldest generation walks all of them, holding the GIL, so the iteration
thread stops for the walk: in the serving loop of `studies/engine_gpu` on an
H200 (2,000 requests at once), collections took 12.6 % of the loop's wall
time, one of them 0.42 s; frozen, 7.6-8.1 % and none over 0.05 s (the `gc`
field of that study's records).  `gc.freeze()` moves what exists at the
end of start-up to a generation no collection visits; objects made later
(requests, their states, the plans) are collected as before, cycles
included.  vLLM's engine core freezes its start-up heap the same way.

The serving loop then allocates a few objects per token (outputs, events,
deliveries) and per iteration (plans, their lists), which die by reference
count, yet the default collector runs a young collection every 700 net
allocations, about once an iteration, and finds nothing: in the loop's host
path alone (`studies/engine_gpu/README.md`, "The serving loop's host path
on a CPU": the pass and sampling taken out, a 1,000-request burst on one
core) no collection freed a single object.  With the young threshold at
3,000 (`SERVING_THRESHOLDS`) the same runs spent 0.20-0.22 s collecting
instead of 0.44-0.61 s under FCFS, 0.15-0.23 s instead of 0.85-1.07 s under
the MLFQ with recompute and 0.35-0.59 s instead of 0.96-1.40 s with
proactive swapping; the longest pause went from 17-20 ms to 12-29 ms under
FCFS and shortened under the MLFQ (34-46 ms to 10-40 ms).  What the loop
keeps from each iteration sets how often young collections run: its
records of recent iterations and plans (`deployments/loop_stats.py`) are
tuples of plain values, a few a record, which the collector stops tracking.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("ray.serve")

# (youngest, middle, oldest) generation thresholds while the replica serves.
SERVING_THRESHOLDS = (3000, 10, 10)

# Iterations between the young collections the serving loop runs itself.
YOUNG_EVERY = 16


class YoungCollections:
    """Young collections at the serving loop's own cadence.

    The threshold counts tracked objects made less those freed, old ones
    included, and on Python 3.11 a tuple taken from the free list is not
    counted while one given back past it is: when a replica frees old
    objects as fast as it keeps new ones (finished requests, a pool of
    KV blocks filling), the young generation grows unnoticed and the
    collection that finally comes walks all of it.  In the loop on an
    emulated H200 (`studies/engine_gpu/README.md`, "Young collections at
    the loop's own cadence") one held 78,668 objects and took 98 ms, and
    the loop's longest pause was such a collection (79-81 ms); collected
    every 16 iterations, the longest pause was 26-31 ms, for 1-1.5 % more
    time collecting.  The young generation then holds what that many
    iterations kept; the loop runs it once the next pass is launched."""

    __slots__ = ("every", "_left")

    def __init__(self, every: int = YOUNG_EVERY) -> None:
        self.every = every
        self._left = every

    def tick(self) -> None:
        """One iteration done: collect the young generation every
        `every`-th call."""
        self._left -= 1
        if self._left <= 0:
            self._left = self.every
            gc.collect(0)


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then freeze the rest; returns
    how many objects are now frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def prepare_serving_heap() -> int:
    """`freeze_startup_heap`, then young collections every
    `SERVING_THRESHOLDS[0]` net allocations instead of 700; returns how
    many objects are frozen (and logs it)."""
    frozen = freeze_startup_heap()
    gc.set_threshold(*SERVING_THRESHOLDS)
    log.info("start-up heap frozen: %d objects left out of garbage collection; young ones "
             "collected every %d allocations", frozen, SERVING_THRESHOLDS[0])
    return frozen


@contextmanager
def serving_heap() -> Iterator[int]:
    """The serving heap for the duration of a block (a benchmark that plans
    as a replica does, `bench/plan_time.py`): frozen and thresholds set on
    entry, both as they were on exit; yields how many objects are frozen."""
    thresholds = gc.get_threshold()
    frozen_before = gc.get_freeze_count()
    frozen = freeze_startup_heap()
    gc.set_threshold(*SERVING_THRESHOLDS)
    try:
        yield frozen
    finally:
        gc.set_threshold(*thresholds)
        if not frozen_before:  # (a heap frozen before stays so: no partial thaw)
            gc.unfreeze()
