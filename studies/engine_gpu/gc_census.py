"""What the young generation holds when the collector runs.

Every young collection walks the objects allocated since the last one and
still alive; what a loop keeps per iteration sets how often that happens
(`engine/gc_heap.py`).  `GcCensus` counts the young generation's objects by
kind at the start of every `every`-th young collection: tuples by length
and the kinds of their first items, lists and sets by their items' kind;
and it keeps the largest young generation any collection found, with how
long that collection took.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from typing import Any


def kind(obj: object) -> str:
    name = type(obj).__name__
    if type(obj) is tuple:
        return f"tuple{len(obj)}({','.join(type(x).__name__ for x in obj[:3])})"
    if type(obj) in (list, set):
        first = next(iter(obj), None)  # type: ignore[call-overload]
        return f"{name}({type(first).__name__ if obj else ''})"
    return name


class GcCensus:
    """Counts the young generation's objects by `kind` until `stop`."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.young = 0
        self.samples = 0
        self.kinds: Counter[str] = Counter()
        # (objects, seconds) of the collection that found the most young objects.
        self.largest: tuple[int, float] = (0, 0.0)
        self._size = 0
        self._began = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 0:
            return
        if phase == "stop":
            if self._size > self.largest[0]:
                self.largest = (self._size, time.perf_counter() - self._began)
            return
        self.young += 1
        young = gc.get_objects(0)
        self._size = len(young)
        if self.young % self.every == 0:
            self.samples += 1
            self.kinds.update(kind(o) for o in young)
        del young
        self._began = time.perf_counter()

    def stop(self) -> None:
        gc.callbacks.remove(self._on)

    def summary(self, top: int = 20) -> dict[str, Any]:
        """The `top` kinds by their mean count in a sampled collection."""
        n = max(1, self.samples)
        return {"every": self.every, "samples": self.samples,
                "objects_per_collection": round(sum(self.kinds.values()) / n),
                "largest": {"objects": self.largest[0],
                            "ms": round(self.largest[1] * 1000, 3)},
                "kinds": {k: round(c / n) for k, c in self.kinds.most_common(top)}}
