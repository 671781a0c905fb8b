"""The collection timer of `studies/engine_gpu/engine_loop.py`."""

from __future__ import annotations

import gc

from studies.engine_gpu.engine_loop import GcTimes


def test_collections_are_counted_by_generation_and_long_ones_apart() -> None:
    times = GcTimes()
    kept = []
    gc.disable()  # only these collections, the large one on a young generation
    try:
        gc.collect(0)
        gc.collect(1)
        # A young generation of a million tracked objects: a pause well over 10 ms.
        kept.append([[i] for i in range(1_000_000)])
        gc.collect(0)
    finally:
        gc.enable()
        times.stop()
    summary = times.summary()
    assert summary["count"] == [2, 1, 0]
    assert summary["over_10ms"] >= 1 and summary["longest_s"] >= 0.010
    assert summary["longest_thread"] == "MainThread"
    n = sum(summary["count"])
    gc.collect(0)
    assert sum(times.summary()["count"]) == n  # stopped
