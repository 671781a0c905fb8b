"""EconoServe's prompt tasks (§3.3.1, Algorithm 1 line 5): after the GTs'
decodes, PTs fill the iteration up to the target forward size with the KV
the batch's allocations leave (the reserve included), each allocated its
whole prompt's blocks; in deadline-range order, a PT past its deadline
that does not fit stops new prompts until it does.  A mixin of
`EconoservePolicy`, which holds the state."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.blocks import BlockManager
from scheduler.config import EconoserveConfig
from scheduler.job import Job
from scheduler.plan import Plan, ScheduledChunk
from scheduler.policies.kv_profile import Profile
from scheduler.policies.task_queue import TaskQueue
from scheduler.swap import SwapManager


class PromptFilling:
    blocks: BlockManager
    swap: SwapManager
    pts: TaskQueue
    _prefilling: dict[str, Job]
    ec: EconoserveConfig

    if TYPE_CHECKING:  # `Policy` and `EconoservePolicy` provide them
        def profile(self) -> Profile: ...
        def _held_by_batch(self) -> int: ...
        def chunk_for(self, job: Job, num_tokens: int) -> ScheduledChunk: ...

    def _fill_pts(self, plan: Plan, chunks: list[ScheduledChunk], budget: int,
                  now: float) -> None:
        if not self.pts or budget <= 0:
            return
        prof = self.profile()
        held_batch = self._held_by_batch()
        # Free blocks promised neither to the batch's allocations nor to
        # the rest of the prompts already started.
        started = sum(self.blocks.blocks_needed(j, j.num_uncomputed_tokens)
                      for j in self._prefilling.values() if j.is_resident)
        headroom = self.blocks.num_free - max(0, prof.peak - held_batch) - started
        taken: set[str] = set()
        i = 0
        while budget > 0 and i < len(self.pts):
            job = self.pts.at(i)
            if job.job_id in taken or job.swap_pending is not None:
                i += 1
                continue
            if job.num_host_blocks:  # swapped out mid-prompt: bring it back first
                n = job.num_host_blocks
                if n <= headroom:
                    ops = self.swap.swap_in(job)
                    if ops is not None:
                        plan.block_ops += ops
                        headroom -= n
                i += 1
                continue
            n = job.num_uncomputed_tokens
            if n > budget:
                other = None if not self.ec.ordering else self.pts.longest_fitting(
                    i, -budget, lambda j: (j.job_id not in taken and j.swap_pending is None
                                           and not j.num_host_blocks))
                if other is not None:
                    job, n = other, other.num_uncomputed_tokens
                else:
                    n = budget  # chunked prefill
            # Blocks computed since it arrived are adopted (its queue key keeps
            # the longer prompt until the next resort, as a chunked one's does).
            free = self.blocks.num_free
            adopted = self.blocks.reclaim_cached(job)
            taken_free = free - self.blocks.num_free  # parked ones count as free
            headroom -= taken_free
            n = min(n, job.num_uncomputed_tokens)
            # A PT is allocated its whole prompt's blocks (§3.3.1).  One that
            # does not fit is passed over for shorter ones, unless it is past
            # its deadline: then no new prompt starts until it fits.
            need = self.blocks.blocks_needed(job, job.num_uncomputed_tokens)
            if job.job_id in self._prefilling:
                headroom += need  # already counted as started
            if need > headroom or not self.blocks.grow(job, n):
                if job.job_id in self._prefilling:
                    headroom -= need
                if adopted is not None:  # it would not fit without them either
                    self.blocks.undo_adoption(job, adopted)
                    headroom += taken_free
                if self.ec.ordering and self.pts.key(job)[0] == 0:
                    break
                taken.add(job.job_id)  # passed over this iteration
                continue
            headroom -= need
            taken.add(job.job_id)
            if job.num_uncomputed_tokens > n:
                self._prefilling[job.job_id] = job
            chunks.append(self.chunk_for(job, n))
            budget -= n
