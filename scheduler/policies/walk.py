"""The priority walk of one MLFQ plan: jobs in queue order until the batch
is full (FastServe §4.1, the highest-priority ready jobs each iteration)."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain, takewhile
from operator import itemgetter
from typing import Any

from scheduler.job import Job


class Walk:
    """An iteration's walk over the jobs in priority order, lazy so that a
    plan that fills its batch early never touches the rest of the queue.
    `narrow(job, candidates)` restricts the rest of the walk, once, to those
    of `candidates` that rank after `job` (`narrow_to(rest)` where the
    caller has them in order already)."""

    def __init__(self, jobs: Iterable[Job], rank: Callable[[Job], Any]) -> None:
        self._jobs = jobs
        self.rank = rank
        self._rest: Iterable[Job] | None = None

    @property
    def narrowed(self) -> bool:
        return self._rest is not None

    def narrow(self, job: Job, candidates: Iterable[Job]) -> None:
        if self._rest is not None:
            return
        here = self.rank(job)
        rest = []
        for j in candidates:
            try:
                r = self.rank(j)
            except KeyError:  # holds blocks but is not this policy's (a held sibling)
                continue
            if r > here:
                rest.append((r, j))
        rest.sort(key=lambda rj: rj[0])
        self._rest = [j for _, j in rest]

    def narrow_to(self, rest: Iterable[Job]) -> None:
        if self._rest is None:
            self._rest = rest

    def __iter__(self) -> Iterator[Job]:
        # Iterated in C, item by item (a plan reads most of its batch from
        # the narrowed rest): the jobs until the walk is narrowed (the one
        # drawn after that is dropped; drawing it changes nothing), then
        # the rest.
        return chain.from_iterable(self._phases())

    def _phases(self) -> Iterator[Iterable[Job]]:
        yield takewhile(self._not_narrowed, self._jobs)
        yield self._rest or ()

    def _not_narrowed(self, _: Job) -> bool:
        return self._rest is None


def queue_order(levels: Mapping[int, Sequence[dict[str, Job]]]) -> Iterator[Job]:
    """Jobs by (priority class, level, position in level), lazily."""
    return chain.from_iterable(q.values() for p in sorted(levels) for q in levels[p])


class WalkOrder:
    """The jobs a proactive MLFQ's walk visits, in rank order (priority,
    level, entry into the level): every job but those whose KV is only on
    the host.  Under memory pressure those are most of the queue (about
    650 of 1,000 jobs in `bench/plan_time.py`) and lie ahead of the jobs the
    walk wants, so passing over them by set lookup cost a plan about as
    much as its ENST ranking; kept here as jobs change instead."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._rank: dict[str, Any] = {}
        self._by_rank: list[tuple[Any, str]] = []

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def put(self, job: Job, rank: Any) -> None:
        """`job` is walked, at `rank` (added, or moved if its rank changed)."""
        jid = job.job_id
        old = self._rank.get(jid)
        if old is not None:
            if old == rank:
                return
            del self._by_rank[bisect_left(self._by_rank, (old, jid))]
        self._rank[jid] = rank
        self._jobs[jid] = job
        insort(self._by_rank, (rank, jid))

    def discard(self, job_id: str) -> None:
        old = self._rank.pop(job_id, None)
        if old is not None:
            del self._jobs[job_id]
            del self._by_rank[bisect_left(self._by_rank, (old, job_id))]

    def jobs(self) -> Iterator[Job]:
        """The members in rank order, as they are now (a copy of the order:
        the walk may run while members change)."""
        return map(self._jobs.__getitem__, map(itemgetter(1), self._by_rank[:]))

