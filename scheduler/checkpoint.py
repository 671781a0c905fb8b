"""Which KV blocks to checkpoint this iteration (ConServe §4.4–§4.5).

Checkpointing pays off only for jobs that will be preempted, which happens
only under memory pressure, so nothing is copied while device use stays
under `checkpoint_threshold`.  Above it the share of offline jobs covered
grows linearly with use, from one job at the threshold to all of them with
a full cache (the paper's "gradually increase the number of offline
requests to checkpoint", after random early detection).  Jobs are taken in
the order they would be evicted, so the next victim is the first to be
covered.  An iteration copies at most what the host tier stores while it
computes, at the copy rate the engine measures (the I/O budget, §4.5), and
never more than `checkpoint_max_blocks`; the rest wait for a later one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

from scheduler.config import ConserveConfig, SurvivalConfig
from scheduler.job import Job
from scheduler.plan import BlockOp
from scheduler.swap import SwapManager


def jobs_to_cover(num_jobs: int, utilization: float, threshold: float) -> int:
    """How many of `num_jobs` candidates to checkpoint at this device use."""
    if num_jobs == 0 or utilization < threshold:
        return 0
    share = 1.0 if threshold >= 1.0 else (utilization - threshold) / (1.0 - threshold)
    return max(1, min(num_jobs, math.ceil(share * num_jobs)))


def plan_checkpoints(swap: SwapManager, victims_first: Iterable[Job],
                     cfg: ConserveConfig) -> list[BlockOp]:
    """CHECKPOINT ops for the jobs of `victims_first` (most likely to be
    evicted first) that this iteration covers."""
    if not cfg.checkpoint or swap.host_capacity == 0:
        return []
    candidates = [j for j in victims_first if j.block_table and j.is_resident]
    n = jobs_to_cover(len(candidates), swap.blocks.utilization, cfg.checkpoint_threshold)
    return _copy_in_order(swap, candidates[:n], cfg.checkpoint_max_blocks)


def survival_checkpoints(swap: SwapManager, running: Iterable[Job],
                         cfg: SurvivalConfig) -> list[BlockOp]:
    """CHECKPOINT ops that keep every running job's KV copied to the host
    tier up to its last `every_blocks` full blocks (`survival.checkpoint`),
    within the iteration's copy budget; the jobs furthest behind first."""
    # Most iterations no job has filled `every_blocks` since its last copy:
    # only those that have are sorted.
    due = [(n, j) for j in running if (n := swap.checkpointable(j)) >= cfg.every_blocks]
    if not due:
        return []
    due.sort(key=lambda x: -x[0])
    return _copy_in_order(swap, [j for _, j in due], cfg.max_blocks_per_iteration)


class Exposure(NamedTuple):
    """What a replica's death now would cost its resident jobs: the tokens
    each computed past its last checkpoint, which another replica would
    recompute (`survival.checkpoint`).  Checkpoints issued but still queued
    on the tier's thread count as taken here; the tier reports those."""

    jobs: int
    tokens: int
    largest: int


def exposure(jobs: Iterable[Job], block_size: int) -> Exposure:
    n = total = largest = 0
    for job in jobs:
        if not job.block_table or not job.is_resident:
            continue
        lag = max(0, job.num_computed_tokens - job.num_checkpointed_blocks * block_size)
        n += 1
        total += lag
        largest = max(largest, lag)
    return Exposure(n, total, largest)


def _copy_in_order(swap: SwapManager, jobs: list[Job], max_blocks: int) -> list[BlockOp]:
    """CHECKPOINT ops for `jobs`' uncopied full blocks, in order, within the
    iteration's copy budget and the host tier's room."""
    budget = swap.copies_per_iteration(max_blocks)
    ops: list[BlockOp] = []
    for job in jobs:
        if budget <= 0 or swap.host_free <= 0:
            break
        got = swap.checkpoint(job, budget)
        budget -= sum(op.num_blocks for op in got)
        ops += got
    return ops
