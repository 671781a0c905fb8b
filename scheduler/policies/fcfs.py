"""FCFS with iteration-level scheduling and run-to-completion (vLLM's policy).

The baseline every seed paper beats.  Running jobs keep their place in
arrival order; new jobs join at the tail when the batch has room; when the
KV cache runs out, the most recently admitted running job is preempted:
its KV is dropped and recomputed when it is admitted again (`swap_mode:
recompute`, vLLM v1), or swapped to the host tier and swapped back in when
its turn comes (`reactive`, vLLM v0's swap; FCFS has no notion of "ahead of
its turn", so `proactive` behaves as `reactive` here).  Prompts are prefilled in chunks that share the
iteration's token budget with decodes (chunked prefill).
"""

from __future__ import annotations

from collections import deque

from scheduler.job import Job
from scheduler.plan import Plan, ScheduledChunk
from scheduler.policy import Policy


class FCFSPolicy(Policy):
    name = "fcfs"

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def remove(self, job: Job) -> None:
        if job in self.running:
            self.running.remove(job)
        elif job in self.waiting:
            self.waiting.remove(job)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return len(self.running)

    def schedule(self, step: int) -> Plan:
        plan = Plan(step=step)
        budget = self.config.max_batch_tokens
        chunks: list[ScheduledChunk] = []

        i = 0
        while i < len(self.running) and budget > 0:
            job = self.running[i]
            if not job.is_resident:  # a swap-in still in flight
                i += 1
                continue
            n = min(job.num_uncomputed_tokens, budget)
            while not self.blocks.grow(job, n):
                victim = self._newest_evictable()
                if victim is None:
                    break  # only in-flight swap-ins hold memory: wait for them
                self.running.remove(victim)
                self.evict(victim, plan.block_ops)
                self.waiting.appendleft(victim)
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
                self.waiting
                and budget > 0
                and len(self.running) < self.config.max_batch_size
            ):
                job = self.waiting[0]
                if job.num_host_blocks:
                    ops = self.swap.swap_in(job)
                    if ops is None:
                        break
                    plan.block_ops += ops
                    self.running.append(self.waiting.popleft())
                    continue  # it runs once the copy lands
                n = min(job.num_uncomputed_tokens, budget)
                if not self.blocks.grow(job, n):
                    break
                self.waiting.popleft()
                self.running.append(job)
                chunks.append(self.chunk_for(job, n))
                budget -= n

        plan.chunks = chunks
        return plan

    def _newest_evictable(self) -> Job | None:
        for job in reversed(self.running):
            if job.swap_pending is None:
                return job
        return None
