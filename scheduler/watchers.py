"""Change sets for followers of a collection of jobs.

A structure kept beside a collection (the MLFQ's ENST-ordered sets beside
`BlockManager.holding` and `SwapManager.on_host`) would otherwise find what
changed by comparing both every plan, which costs their size.  Instead the
collection's owner adds the id of every job that joins or leaves it to each
follower's set, and the follower empties its set as it catches up.
"""

from __future__ import annotations

from collections.abc import Iterable


class Watchers:
    def __init__(self) -> None:
        self._sets: list[set[str]] = []

    def follow(self, current: Iterable[str]) -> set[str]:
        """A new follower's set, starting with the collection's members."""
        changed = set(current)
        self._sets.append(changed)
        return changed

    def changed(self, job_id: str) -> None:
        for s in self._sets:
            s.add(job_id)
