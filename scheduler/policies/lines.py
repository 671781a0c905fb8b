"""The waiting jobs of a policy that serves by priority, then arrival.

Shared by FCFS and by the co-serving policy (one set of lines per job
class there).
"""

from __future__ import annotations

from bisect import insort
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from scheduler.job import Job


def _later_arrival_first(job: Job) -> int:
    return -job.arrival_seq


@dataclass(eq=False)
class _Line:
    """The waiting jobs of one priority."""

    # Preempted, most recently preempted first.
    requeued: deque[Job] = field(default_factory=deque)
    # Not yet run, latest arrival first, so that the next one pops off the
    # end and a sibling released late still lands at its arrival place.
    fresh: list[Job] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requeued) + len(self.fresh)


class WaitingLines:
    """Waiting lines by priority, the lowest value served first: within a
    priority, preempted jobs (most recently preempted first), then jobs not
    yet run in arrival order (vLLM v1 prepends a preempted job)."""

    def __init__(self) -> None:
        self._lines: dict[int, _Line] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Job]:
        for p in sorted(self._lines):
            line = self._lines[p]
            yield from line.requeued
            yield from reversed(line.fresh)

    def _line(self, job: Job) -> _Line:
        line = self._lines.get(job.priority)
        if line is None:
            line = self._lines[job.priority] = _Line()
        return line

    def add(self, job: Job) -> None:
        insort(self._line(job).fresh, job, key=_later_arrival_first)
        self._len += 1

    def requeue(self, job: Job) -> None:
        self._line(job).requeued.appendleft(job)
        self._len += 1

    def head(self) -> Job:
        line = self._lines[min(self._lines)]
        return line.requeued[0] if line.requeued else line.fresh[-1]

    def pop_head(self) -> Job:
        p = min(self._lines)
        line = self._lines[p]
        job = line.requeued.popleft() if line.requeued else line.fresh.pop()
        self._dropped(p, line)
        return job

    def remove(self, job: Job) -> bool:
        line = self._lines.get(job.priority)
        if line is None:
            return False
        if job in line.requeued:
            line.requeued.remove(job)
        elif job in line.fresh:
            line.fresh.remove(job)
        else:
            return False
        self._dropped(job.priority, line)
        return True

    def _dropped(self, p: int, line: _Line) -> None:
        self._len -= 1
        if not line:
            del self._lines[p]
