"""KV swapping between device blocks and the host tier (FastServe §4.2).

Bookkeeping only.  A swap-out emits SWAP_OUT ops and frees the job's device
blocks at once: the engine copies them out before anything of the same plan
writes to the cache (the contract in `scheduler/plan.py`), and ships the
copy to the host tier off the critical path.  The host copy is the job's
own, all of its blocks; prompt blocks it shares with a sibling
(`scheduler/sharing.py`) stay on the device for the sibling, and the job
comes back into fresh blocks of its own.  A swap-in allocates device
blocks and emits SWAP_IN ops; the job becomes runnable only when the engine
reports the copy landed (`StepResult.swaps_in_done`), so a slow fetch delays
that job alone; one whose copy is lost (`swaps_in_failed`) is recomputed
from scratch.  Host capacity is counted in blocks; when the host tier is
full the caller falls back to recomputation, and `num_recompute_fallbacks`
says so.

Checkpoints (ConServe §4.4) are host copies of a running job's full blocks,
taken a few at a time while the job keeps computing.  Preempting a job
with a checkpoint is a discard: its device blocks are free at once, with
no copy on the critical path, and only the tokens past the checkpoint are
computed again.  Resuming it fetches the checkpoint with PREFETCH, which
keeps the host copy, so a job preempted again loses nothing already
checkpointed.  A job's host footprint is the larger of its checkpoint and
its swapped-out blocks (`host_blocks`).
"""

from __future__ import annotations

import enum

from scheduler.blocks import BlockManager
from scheduler.job import BlockLocation, Job
from scheduler.plan import BlockOp, BlockOpKind
from scheduler.watchers import Watchers


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
        # Of those, the ids of jobs whose KV is only there: no device block,
        # no fetch in flight.  A proactive MLFQ's walk leaves them out (they
        # come back by its ENST-ordered prefetch, not by the walk), following
        # this set's changes (`watch_host_only`, scheduler/policies/mlfq_walk.py).
        self.host_only: set[str] = set()
        self._host_watchers = Watchers()
        self._host_only_watchers = Watchers()
        self.num_swap_out = 0
        self.num_swap_in = 0
        self.blocks_out = 0
        self.blocks_in = 0
        # Swap-in blocks found still on the device, not copied back.
        self.blocks_kept = 0
        self.num_recompute_fallbacks = 0
        self.blocks_checkpointed = 0
        self.num_checkpoint_discards = 0
        # Computed tokens given up by discards (past their checkpoint), and
        # by preemptions that dropped all of a job's KV (to recompute).
        self.tokens_discarded = 0
        self.tokens_dropped = 0
        # The host tier's copy rate (blocks/s) and the last iteration's time,
        # from the engine's results: what one iteration can copy.
        self.copy_rate: float | None = None
        self.iteration_time = 0.0

    def watch_on_host(self) -> set[str]:
        """`BlockManager.watch_holding` for `on_host`."""
        return self._host_watchers.follow(self.on_host)

    def watch_host_only(self) -> set[str]:
        """`BlockManager.watch_holding` for `host_only`."""
        return self._host_only_watchers.follow(self.host_only)

    def _to_host(self, job: Job) -> None:
        """`job`'s KV is now only in the host tier."""
        if job.job_id not in self.on_host:
            self.on_host[job.job_id] = job
            self._host_watchers.changed(job.job_id)
        self._set_host_only(job.job_id, True)

    def _off_host(self, job_id: str) -> None:
        if self.on_host.pop(job_id, None) is not None:
            self._host_watchers.changed(job_id)
        self._set_host_only(job_id, False)

    def _set_host_only(self, job_id: str, only: bool) -> None:
        if (job_id in self.host_only) != only:
            if only:
                self.host_only.add(job_id)
            else:
                self.host_only.discard(job_id)
            self._host_only_watchers.changed(job_id)

    def copies_per_iteration(self, cap: int) -> int:
        """Blocks the tier stores while one iteration computes (ConServe
        §4.5's I/O budget), at most `cap`; `cap` until both are measured."""
        if self.copy_rate is None or self.iteration_time <= 0.0:
            return cap
        return max(1, min(cap, int(self.copy_rate * self.iteration_time)))

    @property
    def host_free(self) -> int:
        return self.host_capacity - self.host_used

    @staticmethod
    def host_blocks(job: Job) -> int:
        """Blocks of `job` in the host tier, whether or not also on the device."""
        return max(job.num_host_blocks, job.num_checkpointed_blocks)

    # Checkpoints (ConServe §4.4) -------------------------------------------

    def checkpointable(self, job: Job) -> int:
        """Full, computed blocks of `job` without a host copy yet."""
        if not job.is_resident:
            return 0
        full = min(job.num_computed_tokens // self.blocks.block_size, len(job.block_table))
        return max(0, full - job.num_checkpointed_blocks)

    def checkpoint(self, job: Job, max_blocks: int) -> list[BlockOp]:
        """Copy up to `max_blocks` of `job`'s next full blocks to the host,
        as far as the host tier has room."""
        n = min(self.checkpointable(job), max_blocks, self.host_free)
        if n <= 0:
            return []
        k = job.num_checkpointed_blocks
        op = BlockOp(BlockOpKind.CHECKPOINT, job.job_id, k, job.block_table[k:k + n])
        job.num_checkpointed_blocks = k + n
        self.host_used += n
        self.blocks_checkpointed += n
        return [op]

    def discard_to_checkpoint(self, job: Job) -> None:
        """Preempt `job` by freeing its device blocks; it resumes from its
        checkpoint, recomputing only the tokens past it."""
        assert job.num_checkpointed_blocks and job.is_resident, job.job_id
        k = job.num_checkpointed_blocks
        kept = min(job.num_computed_tokens, k * self.blocks.block_size)
        self.tokens_discarded += job.num_computed_tokens - kept
        self.blocks.free(job)
        job.num_computed_tokens = kept
        job.num_host_blocks = k
        self._to_host(job)
        self.num_checkpoint_discards += 1

    def adopt(self, job: Job, num_blocks: int) -> None:
        """`job` arrives with the KV of its first `num_blocks` blocks already
        in the host tier (written by another replica): it is where
        `discard_to_checkpoint` leaves a job, and comes back by PREFETCH."""
        assert not job.block_table and job.swap_pending is None, job.job_id
        job.num_checkpointed_blocks = job.num_host_blocks = num_blocks
        job.num_computed_tokens = num_blocks * self.blocks.block_size
        self.host_used += num_blocks
        self._to_host(job)

    def can_swap_out(self, job: Job) -> bool:
        return (
            job.swap_pending is None
            and job.num_host_blocks == 0
            and job.num_checkpointed_blocks == 0
            and bool(job.block_table)
            and len(job.block_table) <= self.host_free
        )

    def swap_out(self, job: Job) -> list[BlockOp]:
        """Copy all of `job`'s device blocks to the host and drop its
        references (blocks a sibling shares stay with the sibling)."""
        assert self.can_swap_out(job), f"cannot swap out {job.job_id}"
        op = BlockOp(BlockOpKind.SWAP_OUT, job.job_id, 0, job.block_table.copy())
        n = op.num_blocks
        self.blocks.free(job)
        self.host_used += n
        job.num_host_blocks = n
        self._to_host(job)
        self.num_swap_out += 1
        self.blocks_out += n
        return [op]

    def swap_in(self, job: Job) -> list[BlockOp] | None:
        """Start copying `job`'s host blocks back; None if no device room.
        A checkpoint comes back by PREFETCH and stays on the host.  Leading
        blocks whose KV is still on the device (the prefix cache indexed
        them) are taken as they are, and only the rest is copied; a job
        whose blocks are all still there runs at once."""
        assert job.swap_pending is None and job.num_host_blocks > 0
        n = job.num_host_blocks
        kept = self.blocks.keep_for_swap_in(job, n)
        if kept is None:
            return None
        # Exactly the blocks holding its computed tokens.
        self.blocks.take(job, n - kept)
        self.blocks_kept += kept
        self.num_swap_in += 1  # a job brought back, whatever it copies
        self._set_host_only(job.job_id, False)
        if kept == n:  # nothing to copy: back already
            if not job.num_checkpointed_blocks:  # a move: no copy lands to drop the host's
                self.pending_ops.append(BlockOp(BlockOpKind.DROP, job.job_id, 0, []))
            self.swap_in_done(job)
            return []
        kind = BlockOpKind.PREFETCH if job.num_checkpointed_blocks else BlockOpKind.SWAP_IN
        job.swap_pending = kind.value
        self.blocks_in += n - kept
        return [BlockOp(kind, job.job_id, kept, job.block_table[kept:n])]

    def swap_in_done(self, job: Job) -> None:
        self._off_host(job.job_id)
        if not job.num_checkpointed_blocks:  # a move: the host copy is gone
            self.host_used -= job.num_host_blocks
        job.num_host_blocks = 0
        job.swap_pending = None
        job.block_locations = [BlockLocation.DEVICE] * len(job.block_table)

    def swap_in_failed(self, job: Job) -> None:
        """The host copy is gone: drop everything, recompute from scratch."""
        self._off_host(job.job_id)
        self.host_used -= self.host_blocks(job)
        job.num_host_blocks = 0
        job.num_checkpointed_blocks = 0
        job.swap_pending = None
        self.blocks.free(job)
        job.num_computed_tokens = 0
        self.num_recompute_fallbacks += 1

    def release_host(self, job: Job, keep: bool = False) -> None:
        """Forget `job`'s host copy (finished, aborted or dropped).  With
        `keep`, the copy stays in the tier for another replica to adopt (a
        job moved elsewhere, scheduler/offline_pool.py): this replica stops
        counting it, and whoever adopts it drops it in the end."""
        self._off_host(job.job_id)
        held = self.host_blocks(job)
        if held:
            self.host_used -= held
            if not keep:
                self.pending_ops.append(BlockOp(BlockOpKind.DROP, job.job_id, 0, []))
        job.num_host_blocks = 0
        job.num_checkpointed_blocks = 0
        job.swap_pending = None

    def take_pending(self) -> list[BlockOp]:
        ops, self.pending_ops = self.pending_ops, []
        return ops
