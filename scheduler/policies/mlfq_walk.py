"""The MLFQ's priority walk (FastServe §4.1): the jobs of one plan in
(priority, level, position in level) order until the batch is full, and its
narrowing to the jobs that hold KV once no other can start.  In proactive
mode the walk leaves out the jobs whose KV is only on the host (the
ENST-ordered prefetch brings them back, never the walk): it reads a
rank-ordered set of the others (`WalkOrder`), kept as jobs change level or
move to and from the host tier, instead of passing over the rest of the
queue each plan.  A mixin of `MLFQPolicy`, which holds the state."""

from __future__ import annotations

import heapq

from scheduler.job import Job
from scheduler.policies.ranked import RankedSet
from scheduler.policies.walk import Walk, WalkOrder, queue_order
from scheduler.swap import SwapManager, SwapMode


class MLFQWalking:
    swap: SwapManager
    swap_mode: SwapMode
    _levels: dict[int, list[dict[str, Job]]]
    _rank: dict[str, tuple[int, int, int]]
    _resident: RankedSet
    _host: RankedSet
    # Made at the first walk (co-serving's MLFQ only orders its jobs and
    # never walks: it keeps nothing, and follows no change).
    _walk_order: WalkOrder | None = None
    _host_only_changed: set[str] | None = None

    def walk(self) -> Walk:
        if self.swap_mode is not SwapMode.PROACTIVE:
            return Walk(queue_order(self._levels), self._walk_rank)
        order = self._walk_order
        if order is None or self._host_only_changed is None:
            order = self._walk_order = WalkOrder()
            self._host_only_changed = self.swap.watch_host_only()
            self._host_only_changed.update(self._rank)
        self._sync_walk_order(order, self._host_only_changed)
        return Walk(order.jobs(), self._walk_rank)

    def _sync_walk_order(self, order: WalkOrder, changed: set[str]) -> None:
        """Catch up with the jobs that moved to or from the host tier since
        the last plan (their ids in `changed`, emptied here)."""
        host_only, rank = self.swap.host_only, self._rank
        for jid in changed:
            r = rank.get(jid)
            if r is None or jid in host_only:
                order.discard(jid)
            else:
                order.put(self._levels[r[0]][r[1]][jid], r)
        changed.clear()

    def _walk_reranked(self, job: Job) -> None:
        """`job` joined the queues or changed level: its place in the walk."""
        order = self._walk_order
        if order is not None:
            if job.job_id in self.swap.host_only:
                order.discard(job.job_id)
            else:
                order.put(job, self._rank[job.job_id])

    def _walk_removed(self, job_id: str) -> None:
        if self._walk_order is not None:
            self._walk_order.discard(job_id)

    def _walk_rank(self, job: Job) -> tuple[int, int, int]:
        return self._rank[job.job_id]

    def _narrow(self, walk: Walk, job: Job, with_host: bool) -> None:
        """The rest of the walk: the jobs ranked after `job` that held device
        blocks when the plan began, and (`with_host`, reactive mode) those
        with a host copy, which the walk would fetch."""
        if walk.narrowed:
            return
        host = with_host and self.swap_mode is SwapMode.REACTIVE
        if walk.rank != self._walk_rank:  # a subclass's own order (bench/oracle.py)
            walk.narrow(job, [*self._resident.members(), *(self._host.members() if host else ())])
            return
        rank = self._rank[job.job_id]
        rest = self._resident.ranked_after(rank)
        if host:
            rest = heapq.merge(rest, self._host.ranked_after(rank), key=self._walk_rank)
        walk.narrow_to(rest)
