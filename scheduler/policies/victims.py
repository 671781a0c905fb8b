"""Eviction candidates of one MLFQ plan (FastServe §4.2): device-holding jobs
that the plan may swap out, least important class first, largest ENST
first within a class."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from scheduler.blocks import BlockManager, ReleaseTally
from scheduler.job import Job

# A job swapped in is not swapped out again for this many steps unless
# memory for a higher-priority job leaves no other choice (no ping-pong).
MIN_RESIDENCY_STEPS = 4


def _pick(group: Iterable[Job], need: int) -> list[Job] | None:
    """The first jobs of `group` whose blocks add up to `need`, when no
    block is shared (each job frees its whole table); None if all do not."""
    picked: list[Job] = []
    freed = 0
    for j in group:
        if freed >= need:
            break
        picked.append(j)
        freed += len(j.block_table)
    return picked if freed >= need else None


class VictimPool:
    """A job is a candidate once the priority walk has not yet reached it
    (lower priority than every job being served) and it is neither taken
    into the batch nor already evicted.

    `holders` yields the jobs that held device blocks when the plan began,
    largest ENST key (expected to run last) first, the order the pool
    evicts in.  It is read lazily and only as far as evictions need, so a
    plan that evicts a few jobs ranks only those.
    """

    def __init__(self, holders: Iterator[Job], step: int, swapped_in_step: dict[str, int],
                 blocks: BlockManager) -> None:
        self.blocks = blocks
        self.visited: set[str] = set()
        self.taken: set[str] = set()
        self.swapped_out: set[str] = set()
        self._source = holders
        self._read: list[Job] = []
        self._step = step
        self._swapped_in_step = swapped_in_step

    def visit(self, job: Job) -> None:
        self.visited.add(job.job_id)

    def evicted(self, job: Job) -> None:
        self.taken.add(job.job_id)
        if job.num_host_blocks:
            self.swapped_out.add(job.job_id)

    def _holders(self) -> Iterator[Job]:
        i = 0
        while True:
            if i == len(self._read):
                job = next(self._source, None)
                if job is None:
                    return
                self._read.append(job)
            yield self._read[i]
            i += 1

    def _settled(self, job: Job) -> bool:
        return (self._step - self._swapped_in_step.get(job.job_id, -10**9)
                >= MIN_RESIDENCY_STEPS)

    def _live(self) -> Iterator[Job]:
        return (j for j in self._holders() if j.job_id not in self.taken and j.block_table)

    def victims(self, need: int) -> list[Job] | None:
        """Enough lower-priority idle jobs to free `need` blocks: settled
        ones first (no ping-pong), freshly swapped-in ones only if that is
        the only way; None if even all of them do not suffice."""
        pick = self._pick_sharing if self.blocks.has_shared else _pick
        for settled_only in (True, False):
            group = (j for j in self._live() if j.job_id not in self.visited
                     and (not settled_only or self._settled(j)))
            picked = pick(group, need)
            if picked is not None:
                return picked
        return None

    def victims_keeping_kv(self, need: int, host_cost: Callable[[Job], int | None],
                           room: int) -> list[Job] | None:
        """`victims` among the jobs whose eviction drops no computed KV:
        `host_cost` gives the host blocks a job's eviction takes (0 back
        to a checkpoint, None if it would lose KV), within `room` in all;
        greedy, in the pool's order."""
        for settled_only in (True, False):
            picked: list[Job] = []
            tally = ReleaseTally(self.blocks)
            left = room
            for j in self._live():
                if tally.freed >= need:
                    break
                if j.job_id in self.visited or (settled_only and not self._settled(j)):
                    continue
                cost = host_cost(j)
                if cost is None or cost > left:
                    continue
                picked.append(j)
                tally.add(j)
                left -= cost
            if tally.freed >= need:
                if self.blocks.has_shared:
                    return [j for j in picked if tally.frees_any(j)]
                return picked
        return None

    def _pick_sharing(self, group: Iterable[Job], need: int) -> list[Job] | None:
        """`_pick` when some blocks are shared: a victim frees the blocks it
        holds alone, and shared ones once all their holders are picked.  A
        job that would free nothing by itself is considered last, and kept
        only if evicting it with the others picked frees some block."""
        picked: list[Job] = []
        deferred: list[Job] = []
        tally = ReleaseTally(self.blocks)
        for j in group:
            if tally.freed >= need:
                break
            if tally.take(j):
                picked.append(j)
            else:
                deferred.append(j)
        if tally.freed >= need:
            return picked
        for j in deferred:
            if tally.freed >= need:
                break
            picked.append(j)
            tally.add(j)
        if tally.freed >= need:
            return [j for j in picked if tally.frees_any(j)]
        return None

    def settled_idle(self) -> "Peek":
        """Evictable jobs not swapped in recently, largest key first, lazily:
        whether a job is evictable is read when the caller reaches it."""
        return Peek(j for j in self._live() if self._settled(j))


_UNREAD = object()


class Peek:
    """An iterator whose next item can be looked at before it is taken.
    Nothing is read until the head is first looked at: most plans never
    look (`MLFQResidency._proactive` asks only while a swap-out could
    happen), and reading the first candidate starts the ENST merge."""

    def __init__(self, items: Iterator[Job]) -> None:
        self._items = items
        self._head: Any = _UNREAD

    @property
    def head(self) -> Job | None:
        if self._head is _UNREAD:
            self._head = next(self._items, None)
        return self._head

    def pop(self) -> Job:
        job = self.head
        assert job is not None
        self._head = next(self._items, None)
        return job
