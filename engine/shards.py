"""What the first shard of a split model (global rank 0: the engine
replica's `ModelRunner`) sends the others each iteration, and how their swap
reports combine.

The first shard keeps every request's state, samples and answers the
scheduler; the other shards (tensor-parallel shards,
engine/tensor_parallel.py, and pipeline stages, engine/pipeline_parallel.py)
run only their slice of each forward pass and their slice of each block
operation.  Each
iteration the first shard hands them a `ShardStep` (the plan's block ops and
the flattened batch it built, so that no other shard repeats the
bookkeeping), runs its own slice, and meets them in the pass's collectives.
A swap-in has landed when it has landed on every shard; it failed when it
failed on any.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.attention import SeqSpan
from engine.swapper import HostKVTier
from scheduler.plan import BlockOp, BlockOpKind


@dataclass(slots=True)
class ShardStep:
    block_ops: list[BlockOp] = field(default_factory=list)
    # The flattened batch (`ModelRunner._prepare`); no pass when empty.
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    spans: list[SeqSpan] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)
    # The pass may be cut between layers (ConServe §4.3), at the same layer
    # on every shard (`engine.preemption.SharedPreemptFlag`).
    preemptible: bool = False
    # How long to wait for a swap-in to land before reporting (plans with
    # no chunks).
    wait_s: float = 0.0


# Swap-ins landed and failed on one shard since its last report.
SwapReport = tuple[list[str], list[str]]


class ShardGroup(Protocol):
    """The shards other than the first, as the first shard drives them."""

    size: int  # every shard, the first included

    def launch(self, step: ShardStep) -> None:
        """Start `step` on every other shard; returns at once."""

    def finish(self) -> list[SwapReport]:
        """Wait for the launched step; each other shard's swap report."""

    def forget(self, job_id: str) -> None:
        """Abandon the job's swap-ins still in flight, in order with the steps."""

    def close(self) -> None: ...


class SwapsInFlight:
    """A job's swap-in lands when it has landed on all `size` shards."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._landed: dict[str, set[int]] = {}

    def issued(self, ops: Sequence[BlockOp]) -> None:
        for op in ops:
            if op.kind in (BlockOpKind.SWAP_IN, BlockOpKind.PREFETCH):
                self._landed.setdefault(op.job_id, set())
            elif op.kind is BlockOpKind.DROP:
                self._landed.pop(op.job_id, None)  # every shard abandons it

    def forget(self, job_id: str) -> None:
        self._landed.pop(job_id, None)

    @property
    def pending(self) -> int:
        return len(self._landed)

    def combine(self, reports: Sequence[SwapReport]) -> SwapReport:
        """Reports in shard order (the first shard's first)."""
        done: list[str] = []
        failed: list[str] = []
        for shard, (landed, lost) in enumerate(reports):
            for job_id in lost:
                if self._landed.pop(job_id, None) is not None:
                    failed.append(job_id)
            for job_id in landed:
                shards = self._landed.get(job_id)
                if shards is None:
                    continue  # failed elsewhere, or forgotten
                shards.add(shard)
                if len(shards) == self.size:
                    del self._landed[job_id]
                    done.append(job_id)
        return done, failed


def shard_suffix(rank: int, world: int) -> str:
    """What one shard's slice of a job's blocks is stored under, after the
    job's id: the shard's global rank and the number of shards and stages
    in all, so that a replica split another way never finds (and fetches) a
    slice of another shape."""
    return f"#shard{rank}of{world}"


def held_by_every_shard(held: Callable[[str], int], job_id: str, world: int) -> int:
    """The leading blocks of `job_id` whose slices every one of `world`
    shards stored (`held`: a tier's count for one key): what a replica split
    the same way can resume the job from (`survival.checkpoint`)."""
    return min(held(job_id + shard_suffix(rank, world)) for rank in range(world))


class ShardTier:
    """One shard's view of a host KV tier shared by all shards: its slice
    of a job's blocks (its heads of its stage's layers) is stored under the
    job's id and the shard's place in the split (`shard_suffix`), so the
    tier's directory holds (and counts) every shard's slice."""

    def __init__(self, tier: HostKVTier, rank: int, world: int) -> None:
        self.tier = tier
        self.suffix = shard_suffix(rank, world)

    def offload(self, job_id: str, indices: list[int], blocks: torch.Tensor,
                ready: Callable[[], None] | None = None) -> Future[bool]:
        return self.tier.offload(job_id + self.suffix, indices, blocks, ready)

    def fetch(self, job_id: str, indices: list[int],
              pinned: bool = False) -> Future[torch.Tensor | None]:
        return self.tier.fetch(job_id + self.suffix, indices, pinned)

    def drop(self, job_id: str) -> None:
        self.tier.drop(job_id + self.suffix)

    def landed(self) -> list[tuple[str, torch.Tensor | None]]:
        return [(j.removesuffix(self.suffix), t) for j, t in self.tier.landed()]

    def __getattr__(self, name: str) -> object:
        # stats, flush, close: the shared tier's
        return getattr(self.tier, name)
