"""The `Policy` interface: plan one iteration from the queues and free blocks.

A policy owns the ordering of the jobs it was given and decides, each
iteration, which of them compute which tokens, which are preempted and which
KV blocks move.  Everything else (job registry, token bookkeeping, finishing
and freeing) is the `SchedulerCore`'s, so a new scheduling idea is one file in
`scheduler/policies/` that subclasses this.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import TYPE_CHECKING, Callable, ClassVar

from scheduler.blocks import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.cost import CostEstimator
from scheduler.job import Job, JobState
from scheduler.plan import BlockOp, Plan, ScheduledChunk
from scheduler.swap import SwapManager, SwapMode

if TYPE_CHECKING:
    from scheduler.policies.mlfq_admission import NewcomerLevel

# An enum member's lookup costs ~0.12 µs on Python 3.11: once per chunk.
_RUNNING = JobState.RUNNING

Clock = Callable[[], float]


class Policy(ABC):
    name: ClassVar[str]

    def __init__(self, config: SchedulerConfig, blocks: BlockManager, clock: Clock,
                 swap: SwapManager | None = None, cost: CostEstimator | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.clock = clock
        self.swap = swap or SwapManager(blocks, config.host_kv_blocks)
        self.cost = cost
        self.swap_mode = SwapMode(config.swap_mode)

    @abstractmethod
    def add(self, job: Job) -> None:
        """A new job arrived (state WAITING)."""

    @abstractmethod
    def remove(self, job: Job) -> None:
        """`job` finished or was aborted; its blocks are already freed."""

    @abstractmethod
    def schedule(self, step: int) -> Plan:
        """Form the next iteration's plan.  May preempt jobs."""

    @abstractmethod
    def num_waiting(self) -> int: ...

    @abstractmethod
    def num_running(self) -> int: ...

    def on_step_done(self, plan: Plan, iteration_time: float) -> None:
        """Hook after the engine ran `plan` (MLFQ demotion uses it)."""

    def on_prediction(self, job: Job) -> None:
        """`job`'s predicted length landed after it was added."""

    def newcomer_levels(self, batch: Collection[str],
                        mean_output_len: float) -> list[NewcomerLevel] | None:
        """For admission: per queue a new job may join, the jobs it would
        wait behind (scheduler/policies/mlfq_admission.py); None where a
        newcomer waits behind every queued job once the batch is full."""
        return None

    # Shared mechanics -------------------------------------------------

    def preempt_recompute(self, job: Job) -> None:
        """Preempt by dropping the job's KV; it is re-prefilled later."""
        self.blocks.free(job)
        self.swap.release_host(job)
        self.swap.tokens_dropped += job.num_computed_tokens
        job.num_computed_tokens = 0
        job.num_preemptions += 1
        if job.state is JobState.RUNNING:
            job.transition(JobState.PREEMPTED)

    def evict(self, job: Job, ops: list[BlockOp]) -> None:
        """Take `job`'s KV off the device: back to its checkpoint when it has
        one (ConServe §4.4: nothing to copy), else swap it out when the mode
        and the host tier allow, else drop it for recomputation."""
        if job.num_checkpointed_blocks and job.is_resident:
            self.swap.discard_to_checkpoint(job)
            job.num_preemptions += 1
            if job.state is JobState.RUNNING:
                job.transition(JobState.PREEMPTED)
            return
        if self.swap_mode is not SwapMode.RECOMPUTE and job.swap_pending is None:
            if self.swap.can_swap_out(job):
                ops += self.swap.swap_out(job)
                job.num_preemptions += 1
                if job.state is JobState.RUNNING:
                    job.transition(JobState.PREEMPTED)
                return
            if job.block_table:
                self.swap.num_recompute_fallbacks += 1
        if job.swap_pending is not None:
            return  # a swap-in in flight holds its blocks until it lands
        self.preempt_recompute(job)

    def chunk_for(self, job: Job, num_tokens: int) -> ScheduledChunk:
        """The chunk computing `job`'s next `num_tokens` uncomputed tokens.

        Blocks must already be allocated (`BlockManager.grow`).
        """
        # Once per scheduled job per iteration: properties inlined.
        if job.num_host_blocks or job.swap_pending is not None:
            raise AssertionError(f"{job.job_id} scheduled while its KV is not resident")
        start = job.num_computed_tokens
        end = start + num_tokens
        outputs = job.output_token_ids
        if job.state is not _RUNNING:
            job.transition(_RUNNING)
        if job.first_scheduled_time is None:
            job.first_scheduled_time = self.clock()
        p = len(job.prompt_token_ids)
        # A decode's token is its job's last output (most chunks of a plan).
        tokens = (outputs[start - p:end - p] if start >= p
                  else job.token_slice(start, end))
        table = job.table_copy
        if table is None or len(table) != len(job.block_table):
            table = job.table_copy = job.block_table.copy()
        return ScheduledChunk(job.job_id, tokens, start, table, end == p + len(outputs),
                              len(outputs))
