"""The young-generation census of `studies/engine_gpu/gc_census.py`."""

from __future__ import annotations

import gc

from studies.engine_gpu.gc_census import GcCensus, kind


def test_kinds_name_tuples_by_length_and_items() -> None:
    assert kind((1, 2)) == "tuple2(int,int)"
    assert kind(("a", 1, (2,), 3.0)) == "tuple4(str,int,tuple)"
    assert kind([1]) == "list(int)" and kind(set()) == "set()"
    assert kind({"a": 1}) == "dict"


def test_a_census_counts_what_the_young_generation_keeps() -> None:
    census = GcCensus(every=1)
    kept = []
    try:
        gc.collect()
        for _ in range(3):
            kept.append([(i, str(i)) for i in range(500)])  # young, alive, tracked
            gc.collect(0)
    finally:
        census.stop()
    summary = census.summary()
    assert summary["samples"] >= 3
    # Each collection saw at least the 500 pairs made since the last one.
    assert summary["kinds"]["tuple2(int,str)"] >= 500
    assert summary["objects_per_collection"] >= 500
    assert summary["largest"]["objects"] >= 500 and summary["largest"]["ms"] > 0
    n = census.samples
    gc.collect(0)
    assert census.samples == n  # stopped
