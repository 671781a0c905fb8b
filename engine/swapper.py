"""Executes a plan's KV block operations against a host KV tier.

The scheduler decides, this copies (the contract in `scheduler/plan.py`):

- SWAP_OUT: the job's device blocks are copied out before the plan's
  forward pass may overwrite them (they are already free in the scheduler's
  books and may be handed to a chunk of the same plan); the copy then
  travels to the tier off the critical path.  On a GPU the copy runs on the
  side stream into pinned host memory and the compute stream waits for it
  on the device: the host neither stalls nor copies through pageable
  memory.  On a CPU it is a copy before the pass.
- CHECKPOINT (ConServe §4.4): the blocks stay in use and no chunk of this
  plan writes them, so on a GPU the copy runs on a side CUDA stream into
  pinned host memory while the pass computes; the tier's thread waits for
  it before storing, and the next plan's work waits for it on the device
  (a block freed meanwhile may be handed out again).  On a CPU it is a
  copy of a few blocks before the pass, as a swap-out is.
- DROP: the tier forgets the job's host copy.
- SWAP_IN and PREFETCH: a fetch is started; when it lands, the blocks are
  written into the device blocks the op names and the job is reported in
  `StepResult.swaps_in_done` (or `swaps_in_failed` if the host copy is
  gone), usually a later iteration than the one that asked.  A swap-in is
  a move: the host copy is dropped once fetched, as the scheduler's
  `SwapManager.swap_in_done` already counts its host blocks free.  On a
  GPU the tier stacks a fetch into pinned memory and the write into the
  device blocks is queued on the compute stream without waiting.  A
  prefetch restores a checkpoint, which stays on the host until the job
  ends (DROP).

The engine states what it needs of a tier (`HostKVTier` below) and the KV
store implements it (`kvstore.tier`), so the engine never imports the KV
store package, nor Ray through it: it runs, and is tested, without Ray.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from engine.copy_rate import CopyRate
from engine.kv_cache import KVCache
from scheduler.plan import BlockOp, BlockOpKind


class HostKVTier(Protocol):
    """What the engine needs from a host tier: per-job blocks, `blocks` a
    tensor [n_blocks, ...] in block order.  Copies run off the iteration's
    critical path; `landed` lists the fetches completed since the last call
    (None: the blocks were lost)."""

    def offload(self, job_id: str, indices: list[int], blocks: torch.Tensor,
                ready: Callable[[], None] | None = None) -> Future[bool]:
        """`ready`, if given, blocks until `blocks` holds its data (a copy
        still in flight on a side stream); called before storing it."""
        ...

    def fetch(self, job_id: str, indices: list[int],
              pinned: bool = False) -> Future[torch.Tensor | None]:
        """`pinned`: the blocks land in page-locked host memory (for an
        asynchronous copy to a GPU)."""
        ...

    def drop(self, job_id: str) -> None: ...

    def landed(self) -> list[tuple[str, torch.Tensor | None]]: ...


@dataclass(slots=True)
class _Fetch:
    future: Future[torch.Tensor | None]
    device_blocks: list[int]
    # A swap-in moves the host copy; a prefetch keeps it.
    keep_host_copy: bool = False


class BlockSwapper:
    def __init__(self, kv_cache: KVCache, tier: HostKVTier, side_stream: bool = True) -> None:
        """`side_stream=False` copies on a GPU as on a CPU (synchronous,
        through pageable memory): for comparisons."""
        self.kv_cache = kv_cache
        self.tier = tier
        self._fetches: dict[str, _Fetch] = {}
        device = torch.device(kv_cache.device)
        self._side: torch.cuda.Stream | None = (
            torch.cuda.Stream(device) if device.type == "cuda" and side_stream else None)
        # Checkpoint copies issued on the side stream since the last plan.
        self._copies: list[torch.cuda.Event] = []
        # Blocks per second the tier stores (`StepResult.copy_rate`).
        self.copy_rate = CopyRate()

    @property
    def num_in_flight(self) -> int:
        return len(self._fetches)

    def order_after_copies(self) -> None:
        """Make the compute stream's next work wait, on the device, for the
        checkpoint copies still reading on the side stream: blocks the last
        plan checkpointed may have been freed since (a job preempted to its
        checkpoint, a job that ended) and handed to this plan's chunks,
        whether or not this plan has block ops of its own.  The runner calls
        this before every pass; nothing waits on the host."""
        if self._copies:
            compute = torch.cuda.current_stream(self.kv_cache.device)
            for done in self._copies:
                compute.wait_event(done)
            self._copies.clear()

    def apply(self, ops: Sequence[BlockOp]) -> None:
        """Run `ops` in plan order; copies out happen before this returns,
        but for checkpoints on a GPU, which overlap this plan's pass."""
        self.order_after_copies()
        i = 0
        while i < len(ops):
            # Consecutive ops of one kind for one job become one transfer.
            j = i
            while j < len(ops) and (ops[j].kind, ops[j].job_id) == (ops[i].kind, ops[i].job_id):
                j += 1
            self._apply_group(ops[i].kind, ops[i].job_id, ops[i:j])
            i = j

    def _apply_group(self, kind: BlockOpKind, job_id: str, ops: Sequence[BlockOp]) -> None:
        indices = [i for op in ops for i in op.block_indices]
        device_blocks = [b for op in ops for b in op.device_blocks]
        if kind in (BlockOpKind.SWAP_OUT, BlockOpKind.CHECKPOINT) and self._side is not None:
            done = self._copy_on_side_stream(job_id, indices, device_blocks)
            if kind is BlockOpKind.SWAP_OUT:
                # This plan's chunks may be handed these blocks.
                torch.cuda.current_stream(self.kv_cache.device).wait_event(done)
            else:
                # Blocks that stay in use: the next plan's work waits.
                self._copies.append(done)
        elif kind in (BlockOpKind.SWAP_OUT, BlockOpKind.CHECKPOINT):
            # A host copy: the tier serialises it on its own thread.
            self._timed(self.tier.offload(job_id, indices,
                                          self.kv_cache.read_blocks(device_blocks).cpu()),
                        len(indices))
        elif kind is BlockOpKind.DROP:
            # The job finished or was aborted: a fetch still in flight must
            # not land in blocks that may already belong to another job.
            self._fetches.pop(job_id, None)
            self.tier.drop(job_id)
        elif kind in (BlockOpKind.SWAP_IN, BlockOpKind.PREFETCH):
            if job_id in self._fetches:
                raise RuntimeError(f"job {job_id}: a swap-in is already in flight")
            self._fetches[job_id] = _Fetch(
                self.tier.fetch(job_id, indices, pinned=self._side is not None), device_blocks,
                kind is BlockOpKind.PREFETCH)
        else:  # pragma: no cover - exhaustive over BlockOpKind
            raise ValueError(f"unknown block op {kind}")

    def _timed(self, future: Future[Any], num_blocks: int) -> None:
        self.copy_rate.started()
        future.add_done_callback(lambda _: self.copy_rate.finished(num_blocks))

    def _copy_on_side_stream(self, job_id: str, indices: list[int],
                             device_blocks: list[int]) -> torch.cuda.Event:
        """Gather and copy the blocks to pinned host memory on the side
        stream, after what the compute stream has queued (the passes that
        wrote them), and hand the copy to the tier, which waits for it
        before storing; returns the copy's event."""
        assert self._side is not None
        compute = torch.cuda.current_stream(self.kv_cache.device)
        self._side.wait_stream(compute)
        with torch.cuda.stream(self._side):
            gathered = self.kv_cache.read_blocks(device_blocks)
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._side)
        self._timed(self.tier.offload(job_id, indices, host, ready=done.synchronize),
                    len(indices))
        return done

    def poll(self, wait_s: float = 0.0) -> tuple[list[str], list[str]]:
        """Install the fetches that have landed; returns (done, failed) jobs.

        `wait_s > 0` blocks until at least one in-flight fetch completes or
        the time is up (for an iteration with nothing else to do).
        """
        futures = [f.future for f in self._fetches.values()]
        if wait_s > 0 and futures and not any(f.done() for f in futures):
            cf.wait(futures, timeout=wait_s, return_when=cf.FIRST_COMPLETED)
        # The futures are the record of what landed; the tier's queue only
        # needs emptying so that it does not hold the fetched tensors.
        self.tier.landed()
        done: list[str] = []
        failed: list[str] = []
        for job_id, fetch in list(self._fetches.items()):
            if not fetch.future.done():
                continue
            del self._fetches[job_id]
            data = self._result(fetch.future)
            if not fetch.keep_host_copy:
                self.tier.drop(job_id)
            if data is None or data.shape[0] != len(fetch.device_blocks):
                failed.append(job_id)
                continue
            self.kv_cache.write_blocks(fetch.device_blocks, data)
            done.append(job_id)
        return done, failed

    def forget(self, job_id: str) -> None:
        """Abandon `job_id`'s fetch: its device blocks may be reused at once."""
        self._fetches.pop(job_id, None)

    @staticmethod
    def _result(future: Future[Any]) -> torch.Tensor | None:
        try:
            return future.result()
        except Exception:  # a lost object, a dead actor: recompute instead
            return None

