"""FCFS with iteration-level scheduling and run-to-completion (vLLM's policy).

The baseline every seed paper beats.  Jobs are served by priority first
(vLLM v1's `priority` scheduling: a lower value runs first), then first come
first served; with every priority equal this is plain FCFS.  Running jobs
keep their place in admission order within their priority; waiting jobs
join in arrival order and are admitted when the batch has room; when the KV
cache runs out, the running job of the largest priority value is preempted,
the most recently admitted one among equals.  A preempted job goes back to
the head of its priority's waiting line (vLLM v1 prepends it), so it is the
first of its priority to be admitted again.  Its KV is dropped and
recomputed then (`swap_mode: recompute`, vLLM v1), or swapped to the host
tier and swapped back in when its turn comes (`reactive`, vLLM v0's swap;
FCFS has no notion of "ahead of its turn", so `proactive` behaves as
`reactive` here).  Prompts are prefilled in chunks that share the
iteration's token budget with decodes (chunked prefill).

The one kind of waiting job that holds KV is a sibling that adopted its
leader's prompt blocks (`scheduler/sharing.py`).  Once no running job holds
those blocks too (the leader finished or was evicted), it is evicted before
any running job: it is not running, and nothing else would ever reclaim
that memory.
"""

from __future__ import annotations

from bisect import insort

from scheduler.job import Job
from scheduler.plan import Plan, ScheduledChunk
from scheduler.policies.lines import WaitingLines
from scheduler.policy import Policy


def _priority(job: Job) -> int:
    return job.priority


class FCFSPolicy(Policy):
    name = "fcfs"

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._waiting = WaitingLines()
        # By priority, admission order within one: served front to back,
        # preempted from the back.
        self.running: list[Job] = []
        # Waiting jobs that hold device blocks: siblings that adopted a prompt.
        self._holding: list[Job] = []

    @property
    def waiting(self) -> list[Job]:
        """Waiting jobs, next to admit first."""
        return list(self._waiting)

    def add(self, job: Job) -> None:
        self._waiting.add(job)
        if job.block_table:
            self._holding.append(job)

    def remove(self, job: Job) -> None:
        if job in self.running:
            self.running.remove(job)
        else:
            self._waiting.remove(job)
            self._forget_holding(job)

    def _forget_holding(self, job: Job) -> None:
        if self._holding and job in self._holding:
            self._holding.remove(job)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def num_running(self) -> int:
        return len(self.running)

    def schedule(self, step: int) -> Plan:
        plan = Plan(step=step)
        budget = self.config.max_batch_tokens
        chunks: list[ScheduledChunk] = []

        i = 0
        while i < len(self.running) and budget > 0:
            job = self.running[i]
            if job.num_host_blocks or job.swap_pending is not None:
                i += 1  # a swap-in still in flight
                continue
            n = min(len(job.prompt_token_ids) + len(job.output_token_ids)
                    - job.num_computed_tokens, budget)
            # Evict until the blocks fit: a victim holding blocks that a
            # sibling holds too gives back only its own (`BlockManager`).
            # The victim is never one already served this iteration: it
            # is the last evictable job, and `job` itself is evictable.
            while not self._grow_reclaiming(job, n, plan):
                victim = self._last_evictable()
                if victim is None:
                    break  # only in-flight swap-ins hold memory: wait for them
                self.running.remove(victim)
                self.evict(victim, plan.block_ops)
                self._waiting.requeue(victim)
                plan.preempted.append(victim.job_id)
                if victim is job:
                    break
            else:
                chunks.append(self.chunk_for(job, n))
                budget -= n
                i += 1
                continue
            if job in self.running:
                i += 1

        # vLLM's rule: an iteration that had to preempt admits nobody new,
        # or the preempted job would be overtaken by later arrivals.
        if not plan.preempted:
            while (
                self._waiting
                and budget > 0
                and len(self.running) < self.config.max_batch_size
            ):
                job = self._waiting.head()
                if job.num_host_blocks:
                    while not self.blocks.can_allocate(job.num_host_blocks):
                        if not self._evict_waiting(job, plan):
                            break
                    ops = self.swap.swap_in(job)
                    if ops is None:
                        break
                    plan.block_ops += ops
                    insort(self.running, self._waiting.pop_head(), key=_priority)
                    continue  # it runs once the copy lands
                adopted = self.blocks.reclaim_cached(job)
                n = min(job.num_uncomputed_tokens, budget)
                if not self._grow_reclaiming(job, n, plan):
                    if adopted is None:
                        break
                    # Short of blocks beside what it adopted: as if it
                    # had found nothing (a chunk into the parked blocks).
                    self.blocks.undo_adoption(job, adopted)
                    n = min(job.num_uncomputed_tokens, budget)
                    if not self._grow_reclaiming(job, n, plan):
                        break
                self._waiting.pop_head()
                self._forget_holding(job)
                insort(self.running, job, key=_priority)
                chunks.append(self.chunk_for(job, n))
                budget -= n

        plan.chunks = chunks
        return plan

    def _grow_reclaiming(self, job: Job, n: int, plan: Plan) -> bool:
        """`BlockManager.grow`, evicting waiting jobs' blocks if that is
        what it takes (they are not running: they lose a prompt they can
        recompute, and nothing else would ever reclaim those blocks)."""
        while not self.blocks.grow(job, n):
            if not self._evict_waiting(job, plan):
                return False
        return True

    def _evict_waiting(self, beside: Job, plan: Plan) -> bool:
        victim = self._waiting_victim(beside)
        if victim is None:
            return False
        self._forget_holding(victim)
        self.evict(victim, plan.block_ops)
        plan.preempted.append(victim.job_id)
        return True

    def _waiting_victim(self, beside: Job) -> Job | None:
        """The least important waiting job other than `beside` holding
        blocks that no running job holds too.  Evicting it, and if need be
        the other waiting holders of the same blocks, gives room back;
        blocks still shared with a running leader would not."""
        if not self._holding:
            return None
        running = {j.job_id for j in self.running}
        idle = [j for j in self._holding if j is not beside
                and not any(self.blocks.holders(b) & running for b in j.block_table)]
        return max(idle, key=lambda j: (j.priority, j.arrival_seq)) if idle else None

    def _last_evictable(self) -> Job | None:
        """The running job of the largest priority value, latest admitted
        among equals, whose blocks may go (vLLM v1's preemption order)."""
        for job in reversed(self.running):
            if job.swap_pending is None:
                return job
        return None
