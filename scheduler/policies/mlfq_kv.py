"""Where the MLFQ's jobs' KV lives (FastServe §4.2): the ENST order of the
jobs holding KV; making room for the walk's jobs by evicting lower-priority
idle ones, largest ENST first; the rule that a job with no KV does not
start by dropping a started job's KV (`mlfq.cold_start_recompute`);
swap-ins; and proactive swapping, which keeps a reserve of free blocks and
brings the smallest-ENST jobs back ahead of their turn.  A mixin of
`MLFQPolicy`, which holds the state."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING

from scheduler.blocks import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.job import Job
from scheduler.plan import BlockOp, Plan
from scheduler.policies.enst import EnstRanking, Shortfall, execute_times
from scheduler.policies.ranked import RankedSet
from scheduler.policies.victims import VictimPool
from scheduler.swap import SwapManager, SwapMode

# Proactive swap-ins per iteration: at most 1/8 of the device blocks, and
# at most what the host tier's link copies in an iteration.
_SWAP_IN_SHARE = 8


class MLFQResidency:
    blocks: BlockManager
    swap: SwapManager
    swap_mode: SwapMode
    class_sizes: Counter[int]
    swapped_in_step: dict[str, int]
    _step: int
    _host: RankedSet
    _resident: RankedSet
    config: SchedulerConfig
    variant: str
    quanta: list[float]
    alpha: float
    last_run: dict[str, float]
    _levels: dict[int, list[dict[str, Job]]]
    _rank: dict[str, tuple[int, int, int]]
    _shortfall: Shortfall | None

    if TYPE_CHECKING:  # `Policy` and `MLFQPolicy` provide them
        def evict(self, job: Job, ops: list[BlockOp]) -> None: ...
        def reserve_target(self, now: float) -> int: ...

    def _evict_for(self, need: int, ops: list[BlockOp], pool: VictimPool,
                   preempted: list[str] | None, keep_kv: int | None = None) -> bool:
        """Free device blocks until `need` are free, from lower-priority idle
        jobs, largest ENST first (FastServe §4.2); all or nothing.  Victims
        are listed in `preempted` when they give way to a job that runs.
        With `keep_kv` (the priority of a job that has no KV yet), only
        victims that lose no KV (`_host_cost`)."""
        if self.blocks.num_free >= need:
            return True
        short = need - self.blocks.num_free
        victims = (pool.victims_keeping_kv(short, partial(self._host_cost, keep_kv),
                                           self.swap.host_free)
                   if keep_kv is not None else pool.victims(short))
        if victims is None:
            return False
        for v in victims:
            self._swap_out(v, ops, pool)
            if preempted is not None:
                preempted.append(v.job_id)
        return self.blocks.num_free >= need

    def _swap_out(self, job: Job, ops: list[BlockOp], pool: VictimPool) -> None:
        self.evict(job, ops)
        pool.evicted(job)

    def _make_room(self, job: Job, n: int, plan: Plan, pool: VictimPool,
                   cold: bool = False) -> bool:
        if self.blocks.grow(job, n):
            return True
        need = self.blocks.blocks_needed(job, n)
        return (self._evict_for(need, plan.block_ops, pool, plan.preempted,
                                job.priority if cold else None)
                and self.blocks.grow(job, n))

    def _start_adopted(self, job: Job, budget: int, plan: Plan, pool: VictimPool,
                       fail: float, cold: bool) -> int:
        """The tokens of `job`'s chunk if it starts on cached KV found as
        it comes up (`BlockManager.reclaim_cached`), with the same room
        rules as a job without KV; 0: none found, or no room beside it, and
        the job is as it was (the walk goes on as for any job without KV)."""
        adopted = self.blocks.reclaim_cached(job)
        if adopted is None:
            return 0
        n = min(job.num_tokens - job.num_computed_tokens, budget)
        need = self.blocks.blocks_needed(job, n)
        if need and (need >= fail or (cold and need > self._cold_cap(job.priority))
                     or not self._make_room(job, n, plan, pool, cold)):
            self.blocks.undo_adoption(job, adopted)
            return 0
        return n

    def _cold_cap(self, priority: int) -> int:
        """At most the blocks a job of `priority` with no KV can get: the
        free ones, what the host tier can take, and every block of the jobs
        that give way without swapping (`_host_cost`)."""
        room = 0 if self.swap_mode is SwapMode.RECOMPUTE else self.swap.host_free
        cap = self.blocks.num_free + room
        if len(self.class_sizes) > 1 or self.swap.blocks_checkpointed:
            cap += sum(len(j.block_table) for j in self.blocks.holding.values()
                       if j.priority > priority or j.num_checkpointed_blocks)
        return cap

    def _host_cost(self, priority: int, job: Job) -> int | None:
        """Host blocks evicting `job` for a job of `priority` takes without
        dropping KV (none back to a checkpoint); None where it would drop
        KV.  A less important class gives way whatever it loses (strict
        classes), so its jobs cost nothing here."""
        if job.priority > priority or (job.num_checkpointed_blocks and job.is_resident):
            return 0
        if self.swap_mode is SwapMode.RECOMPUTE or not self.swap.can_swap_out(job):
            return None
        return len(job.block_table)

    def _swap_in(self, job: Job, ops: list[BlockOp], pool: VictimPool) -> bool:
        if not self._evict_for(job.num_host_blocks, ops, pool, preempted=None):
            return False
        new_ops = self.swap.swap_in(job)
        if new_ops is None:
            return False
        ops += new_ops
        self.swapped_in_step[job.job_id] = self._step
        return True

    def _proactive(self, plan: Plan, pool: VictimPool, ranked: Callable[[], EnstRanking],
                   now: float) -> None:
        """ENST-ordered residency (FastServe §4.2, Figure 9): keep the burst
        reserve free by swapping out the largest-ENST idle jobs, and bring
        the smallest-ENST swapped jobs back ahead of their turn, trading
        places with idle residents whose ENST is larger.  Swap-ins per
        iteration are capped so that the copies overlap the computation
        instead of saturating the link."""
        reserve = self.reserve_target(now)
        idle = pool.settled_idle()  # largest (priority, ENST) first
        # A full host tier (most plans under overload) takes no swap-out:
        # the idle candidates are then not even read.
        swap = self.swap
        while (self.blocks.num_free < reserve and swap.host_free
               and idle.head is not None and swap.can_swap_out(idle.head)):
            self._swap_out_freeing(idle.pop(), plan.block_ops, pool)
        if self.blocks.num_free < reserve and not swap.host_free:
            return  # no swap-in fits below the reserve, and no swap-out makes room
        # The copies overlap the computation (FastServe §4.2) where they are
        # no more than the link moves while an iteration computes, as
        # measured (`copies_per_iteration`); more would only queue behind.
        cap = swap.copies_per_iteration(max(1, self.blocks.num_blocks // _SWAP_IN_SHARE))
        budget = cap
        ranking = ranked()
        host = self._host.ascending(ranking, lambda j: j.swap_pending is None
                                    and j.job_id not in pool.swapped_out)
        for h in host:
            n = h.num_host_blocks
            if n > budget and budget < cap:
                break  # (the first job always goes, however large)
            while (self.blocks.num_free - n < reserve and swap.host_free
                   and idle.head is not None and ranking.key(idle.head) > ranking.key(h)
                   and swap.can_swap_out(idle.head)):
                self._swap_out_freeing(idle.pop(), plan.block_ops, pool)
            if self.blocks.num_free - n < reserve:
                break
            ops = self.swap.swap_in(h)
            if ops is None:
                break
            plan.block_ops += ops
            self.swapped_in_step[h.job_id] = self._step
            budget -= n

    def _swap_out_freeing(self, job: Job, ops: list[BlockOp], pool: VictimPool) -> None:
        """Swap an idle job out for the room it gives back; one whose blocks
        are all held by siblings too would give back none, so it stays."""
        if self.blocks.num_exclusive(job):
            self._swap_out(job, ops, pool)

    # ENST order (FastServe §4.2) -----------------------------------------

    def _ranking(self, now: float) -> EnstRanking:
        counts = {p: [len(q) for q in levels] for p, levels in self._levels.items()}
        return EnstRanking(execute_times(counts, self.quanta, self.config.max_batch_size,
                                         self._shortfall),
                           self._rank, self.last_run, self.alpha, now,
                           promotes=self.variant != "fixed")

    def enst(self, now: float) -> dict[str, float]:
        """Estimated next scheduled time of every job, relative to now (for
        inspection and tests; planning ranks only the jobs it needs with
        `EnstRanking`).  Position inside the level breaks ties."""
        ranking = self._ranking(now)
        out: dict[str, float] = {}
        for levels in self._levels.values():
            for q in levels:
                for pos, job in enumerate(q.values()):
                    out[job.job_id] = ranking.value(job) + pos * 1e-9
        return out

    def _by_enst(self, ranking: Callable[[], EnstRanking]) -> Iterator[Job]:
        """The resident jobs not being swapped in, largest ENST first, ranked
        when the first is read."""
        yield from self._resident.descending(ranking(), _not_in_flight)


def _not_in_flight(job: Job) -> bool:
    return job.swap_pending is None
