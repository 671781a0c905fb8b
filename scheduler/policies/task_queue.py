"""A waiting queue of EconoServe tasks, sorted by a key (§3.4, Ordering).

Keys are tuples ending in the job's arrival number, so they are unique and
a task's place is found by bisection.  A key is computed when the task is
queued; keys that depend on the clock (deadline ranges) are refreshed by
`resort`, which the policy calls every so often rather than on every plan.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterator
from typing import Any

from scheduler.job import Job

Key = tuple[Any, ...]


def deadline_range(deadline: float | None, now: float, bounds: tuple[float, ...]) -> int:
    """A deadline's range by its slack (§3.4): 0 once missed, then one per
    ascending bound the slack is within, the last for none at all."""
    if deadline is None:
        return len(bounds) + 1
    slack = deadline - now
    return 0 if slack <= 0 else bisect_left(bounds, slack) + 1


class TaskQueue:
    def __init__(self) -> None:
        self._keys: list[Key] = []
        self._jobs: dict[Key, Job] = {}
        self._key_of: dict[str, Key] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __contains__(self, job: Job) -> bool:
        return job.job_id in self._key_of

    def __iter__(self) -> Iterator[Job]:
        return (self._jobs[k] for k in list(self._keys))

    def add(self, job: Job, key: Key) -> None:
        assert job.job_id not in self._key_of, job.job_id
        insort(self._keys, key)
        self._jobs[key] = job
        self._key_of[job.job_id] = key

    def remove(self, job: Job) -> bool:
        key = self._key_of.pop(job.job_id, None)
        if key is None:
            return False
        i = bisect_left(self._keys, key)
        del self._keys[i]
        del self._jobs[key]
        return True

    def get(self, job_id: str) -> Job | None:
        key = self._key_of.get(job_id)
        return None if key is None else self._jobs[key]

    def key(self, job: Job) -> Key:
        return self._key_of[job.job_id]

    def at(self, i: int) -> Job:
        return self._jobs[self._keys[i]]

    def index_of(self, job: Job) -> int:
        return bisect_left(self._keys, self._key_of[job.job_id])

    def first_from(self, prefix: Key) -> int:
        """Index of the first task whose key is >= `prefix`."""
        return bisect_left(self._keys, prefix)

    def longest_fitting(self, i: int, bound: Any, usable: Callable[[Job], bool]) -> Job | None:
        """The first usable task after the one at `i` in the same ranges
        (the first two key fields) whose third key field is at least `bound`:
        for PTs keyed by minus their prompt, the longest one that fits a
        token budget of -`bound` whole (bisection, §3.4)."""
        ranges = self._keys[i][:2]
        k = self.first_from(ranges + (bound,))
        while k < len(self._keys) and self._keys[k][:2] == ranges:
            job = self._jobs[self._keys[k]]
            if usable(job):
                return job
            k += 1
        return None

    def resort(self, key: Callable[[Job], Key]) -> None:
        jobs = [self._jobs[k] for k in self._keys]
        self._keys.clear()
        self._jobs.clear()
        self._key_of.clear()
        pairs = sorted(((key(j), j) for j in jobs), key=lambda kj: kj[0])
        for k, j in pairs:
            self._keys.append(k)
            self._jobs[k] = j
            self._key_of[j.job_id] = k
