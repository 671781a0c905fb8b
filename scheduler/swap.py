"""KV swapping between device blocks and the host tier (FastServe §4.2).

Bookkeeping only.  A swap-out emits SWAP_OUT ops and frees the job's device
blocks at once: the engine copies them out before anything of the same plan
writes to the cache (the contract in `scheduler/plan.py`), and ships the
copy to the host tier off the critical path.  The host copy is the job's
own, all of its blocks; prompt blocks it shares with a sibling
(`scheduler/sharing.py`) stay on the device for the sibling, and the job
comes back into fresh blocks of its own.  A swap-in allocates device
blocks and emits SWAP_IN ops; the job becomes runnable only when the engine
reports the copy landed (`StepResult.swaps_done`), so a slow fetch delays
that job alone.  Host capacity is counted in blocks; when the host tier is full the
caller falls back to recomputation, and `num_recompute_fallbacks` says so.
"""

from __future__ import annotations

import enum

from scheduler.blocks import BlockManager
from scheduler.job import BlockLocation, Job
from scheduler.plan import BlockOp, BlockOpKind


class SwapMode(str, enum.Enum):
    # Drop KV on preemption and re-prefill later (vLLM's default).
    RECOMPUTE = "recompute"
    # Swap out only when memory is exhausted; swap in when the job must run.
    REACTIVE = "reactive"
    # Keep a reserve of free blocks by swapping out the largest-ENST jobs
    # early, and swap in the smallest-ENST jobs ahead of their turn.
    PROACTIVE = "proactive"


class SwapManager:
    def __init__(self, blocks: BlockManager, host_capacity_blocks: int) -> None:
        self.blocks = blocks
        self.host_capacity = host_capacity_blocks
        self.host_used = 0
        self.pending_ops: list[BlockOp] = []
        # Jobs with a copy in the host tier (what proactive swap-in ranks).
        self.on_host: dict[str, Job] = {}
        self.num_swap_out = 0
        self.num_swap_in = 0
        self.blocks_out = 0
        self.blocks_in = 0
        self.num_recompute_fallbacks = 0

    @property
    def host_free(self) -> int:
        return self.host_capacity - self.host_used

    def can_swap_out(self, job: Job) -> bool:
        return (
            job.swap_pending is None
            and job.num_host_blocks == 0
            and bool(job.block_table)
            and len(job.block_table) <= self.host_free
        )

    def swap_out(self, job: Job) -> list[BlockOp]:
        """Copy all of `job`'s device blocks to the host and drop its
        references (blocks a sibling shares stay with the sibling)."""
        assert self.can_swap_out(job), f"cannot swap out {job.job_id}"
        ops = [BlockOp(BlockOpKind.SWAP_OUT, job.job_id, i, b)
               for i, b in enumerate(job.block_table)]
        n = len(ops)
        self.blocks.free(job)
        self.host_used += n
        job.num_host_blocks = n
        self.on_host[job.job_id] = job
        self.num_swap_out += 1
        self.blocks_out += n
        return ops

    def swap_in(self, job: Job) -> list[BlockOp] | None:
        """Start copying `job`'s host blocks back; None if no device room."""
        assert job.swap_pending is None and job.num_host_blocks > 0
        n = job.num_host_blocks
        if not self.blocks.can_allocate(n):
            return None
        # Allocate exactly the blocks holding its computed tokens.
        self.blocks.allocate_for(job, n)
        job.swap_pending = BlockOpKind.SWAP_IN.value
        self.num_swap_in += 1
        self.blocks_in += n
        return [BlockOp(BlockOpKind.SWAP_IN, job.job_id, i, b)
                for i, b in enumerate(job.block_table)]

    def swap_in_done(self, job: Job) -> None:
        self.on_host.pop(job.job_id, None)
        self.host_used -= job.num_host_blocks
        job.num_host_blocks = 0
        job.swap_pending = None
        job.block_locations = [BlockLocation.DEVICE] * len(job.block_table)

    def swap_in_failed(self, job: Job) -> None:
        """The host copy is gone: drop everything, recompute from scratch."""
        self.on_host.pop(job.job_id, None)
        self.host_used -= job.num_host_blocks
        job.num_host_blocks = 0
        job.swap_pending = None
        self.blocks.free(job)
        job.num_computed_tokens = 0
        self.num_recompute_fallbacks += 1

    def release_host(self, job: Job) -> None:
        """Forget `job`'s host copy (finished, aborted or dropped)."""
        self.on_host.pop(job.job_id, None)
        if job.num_host_blocks:
            self.host_used -= job.num_host_blocks
            self.pending_ops.append(BlockOp(BlockOpKind.DROP, job.job_id, -1, -1))
        job.num_host_blocks = 0
        job.swap_pending = None

    def take_pending(self) -> list[BlockOp]:
        ops, self.pending_ops = self.pending_ops, []
        return ops
