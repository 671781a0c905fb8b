"""The replica's start-up heap frozen (deployments/gc_heap.py): what exists
is left out of collections, what comes later is still collected."""

from __future__ import annotations

import gc
import weakref

from deployments.gc_heap import freeze_startup_heap


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
