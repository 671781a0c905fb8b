"""The replica's start-up heap frozen (engine/gc_heap.py): what exists
is left out of collections, what comes later is still collected."""

from __future__ import annotations

import gc
import weakref

from engine.gc_heap import (SERVING_THRESHOLDS, YoungCollections, freeze_startup_heap,
                            prepare_serving_heap)


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_the_heap_before_is_frozen_and_later_cycles_are_collected() -> None:
    before = _cycle()  # garbage already: freezing collects it first
    try:
        frozen = freeze_startup_heap()
        assert before() is None
        # At most what was returned: frozen objects freed since (another
        # thread's, a finalizer's) leave the frozen generation.
        assert frozen >= gc.get_freeze_count() > 1000
        later = _cycle()
        assert later() is not None
        gc.collect()
        assert later() is None  # made after the freeze: collected as before
        # Nothing joined the frozen generation (frozen objects freed since leave it).
        assert gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def _young_collections_while(allocate: int) -> int:
    """Young collections that `allocate` new container objects, all kept
    alive, set off from a collector with empty counts."""
    gc.collect()
    starts: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            starts.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        kept = [[] for _ in range(allocate)]
    finally:
        gc.callbacks.remove(seen)
    assert len(kept) == allocate
    return len(starts)


def test_the_serving_heap_collects_young_objects_less_often() -> None:
    before = gc.get_threshold()
    try:
        prepare_serving_heap()
        assert gc.get_threshold() == SERVING_THRESHOLDS and gc.get_freeze_count() > 1000
        # 2,000 allocations (a third of the threshold left for other threads'
        # in this process): not one collection, where Python's default runs two.
        assert _young_collections_while(2000) == 0
        gc.set_threshold(700, *SERVING_THRESHOLDS[1:])
        assert _young_collections_while(2000) >= 2
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_the_loop_collects_the_young_generation_at_its_own_cadence() -> None:
    seen: list[int] = []

    def on(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    young = YoungCollections(every=3)
    gc.disable()  # only the cadence's collections
    gc.callbacks.append(on)
    try:
        cycle = _cycle()
        for _ in range(2):
            young.tick()
        assert seen == [] and cycle() is not None
        young.tick()
        assert seen == [0] and cycle() is None  # a young cycle, collected
        for _ in range(6):
            young.tick()
        assert seen == [0, 0, 0]
    finally:
        gc.callbacks.remove(on)
        gc.enable()
