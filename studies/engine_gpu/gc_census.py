"""What the young generation holds when the collector runs.

Every young collection walks the objects allocated since the last one and
still alive; what a loop keeps per iteration sets how often that happens
(`engine/gc_heap.py`).  `GcCensus` counts the young generation's objects by
kind at the start of every `every`-th young collection: tuples by length
and the kinds of their first items, lists and sets by their items' kind.
"""

from __future__ import annotations

import gc
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
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, int]) -> None:
        if phase != "start" or info["generation"] != 0:
            return
        self.young += 1
        if self.young % self.every:
            return
        self.samples += 1
        self.kinds.update(kind(o) for o in gc.get_objects(0))

    def stop(self) -> None:
        gc.callbacks.remove(self._on)

    def summary(self, top: int = 20) -> dict[str, Any]:
        """The `top` kinds by their mean count in a sampled collection."""
        n = max(1, self.samples)
        return {"every": self.every, "samples": self.samples,
                "objects_per_collection": round(sum(self.kinds.values()) / n),
                "kinds": {k: round(c / n) for k, c in self.kinds.most_common(top)}}
