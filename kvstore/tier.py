"""Host KV tiers: the engine's `HostKVTier` (engine/swapper.py) implemented.

Copies never run on the iteration's critical path: in a `ThreadedHostTier`
stores and drops go to one writer thread (FIFO) and fetches to a reader
thread of their own, and the runner polls for fetches that have landed.

A fetch never waits for a store.  Blocks handed to `offload` and not
stored yet stay with the tier until their store ends (the copy it was
handed), so a job swapped back in before its swap-out reached the store is
served from that copy; blocks stored earlier come from the store.  A slow
store (a loaded host's object store: up to 6 s seen for a 37-block put on a
2-core machine) thus delays neither a swap-in of the same job nor one of
another job queued behind it.  A store of a job dropped before it began is
skipped: the scheduler no longer wants that copy (a swap-in moves the
blocks back and drops the host copy).

- `LocalHostTier`: host memory of this process (tests, single replica
  without Ray).
- `ObjectStoreTier`: Ray's object store through the application's
  `KVDirectory` (kvstore/directory.py), so blocks survive the replica.

A copy that fails (the directory went away with its application, or is
being replaced) counts as a refused offload or a lost fetch, never as an
exception on a worker thread: the scheduler already handles both.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.swapper import HostKVTier
from kvstore.held import leading_blocks
from kvstore.wire import Wire

log = logging.getLogger(__name__)


@dataclass
class TierStats:
    offloads: int = 0
    fetches: int = 0
    bytes_offloaded: int = 0
    bytes_fetched: int = 0
    fetch_failures: int = 0
    offload_failures: int = 0
    # Stores skipped because the job was dropped before they began.
    offloads_skipped: int = 0
    # Fetched blocks served from copies whose store had not ended.
    blocks_fetched_unstored: int = 0
    swap_out_s: float = 0.0
    swap_in_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class _Unstored:
    """One offload not stored yet: its blocks by index, and the wait for a
    device copy still filling them (None: they are filled)."""

    blocks: dict[int, torch.Tensor]
    ready: Callable[[], None] | None
    dropped: bool = False


class ThreadedHostTier(HostKVTier, ABC):
    """A `HostKVTier` whose stores run on one writer thread and fetches on
    one reader thread; a subclass says where the blocks are kept (`_put`,
    `_get`, `_remove`)."""

    def __init__(self) -> None:
        self.stats = TierStats()
        # FIFO across stores and drops: a drop after a store removes it.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-write")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-read")
        self._landed: queue.SimpleQueue[tuple[str, torch.Tensor | None]] = queue.SimpleQueue()
        # Offloads handed over and not stored yet, per job in order: a
        # replica that dies loses them (`pending_blocks`), a fetch reads them.
        self._unstored: dict[str, list[_Unstored]] = {}
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def pending_blocks(self) -> int:
        """Blocks queued for the tier and not stored yet (checkpoints and
        swap-outs): how far the host copies lag behind the scheduler's
        books."""
        return self._pending

    def offload(self, job_id: str, indices: list[int], blocks: torch.Tensor,
                ready: Callable[[], None] | None = None) -> Future[bool]:
        # Copied now, unless a device copy is still filling it (`ready`).
        data = blocks if ready is not None else blocks.contiguous()
        item = _Unstored(dict(zip(indices, data.unbind(0))), ready)
        with self._lock:
            self._pending += len(indices)
            self._unstored.setdefault(job_id, []).append(item)
        return self._writer.submit(self._offload_sync, job_id, indices, data, item)

    def fetch(self, job_id: str, indices: list[int],
              pinned: bool = False) -> Future[torch.Tensor | None]:
        # What is not stored yet is read from its copy, taken now: a later
        # drop or offload of the job does not change what this fetch sees.
        with self._lock:
            unstored: dict[int, tuple[torch.Tensor, Callable[[], None] | None]] = {}
            for item in self._unstored.get(job_id, ()):  # later offloads win
                unstored.update({i: (b, item.ready) for i, b in item.blocks.items()})
        local = {i: unstored[i] for i in indices if i in unstored}
        fut = self._reader.submit(self._fetch_sync, job_id, indices, pinned, local)

        def landed(f: Future[torch.Tensor | None]) -> None:
            # Cancelled by close(): nobody polls any more.
            if not f.cancelled():
                self._landed.put((job_id, None if f.exception() else f.result()))

        fut.add_done_callback(landed)
        return fut

    def drop(self, job_id: str) -> None:
        with self._lock:
            for item in self._unstored.pop(job_id, ()):
                item.dropped = True
        self._writer.submit(self._drop_sync, job_id)

    def held(self, job_id: str) -> int:
        """How many of `job_id`'s blocks, from block 0 on without a gap, the
        tier holds, once the copies queued before have run: the checkpoint
        a job resumes from on another replica (`survival.checkpoint`)."""
        try:
            return self._writer.submit(self._held, job_id).result()
        except Exception as e:  # the directory is gone: nothing to resume from
            log.warning("lookup of %s failed: %r", job_id, e)
            return 0

    def landed(self) -> list[tuple[str, torch.Tensor | None]]:
        """Fetches completed since the last call (None: the blocks were lost)."""
        out = []
        while True:
            try:
                out.append(self._landed.get_nowait())
            except queue.Empty:
                return out

    def flush(self) -> None:
        """Wait for every queued copy (tests, shutdown)."""
        self._writer.submit(lambda: None).result()
        self._reader.submit(lambda: None).result()

    def close(self, wait: bool = True) -> None:
        """Stop the worker threads.  `wait=False` (replica shutdown) drops
        the copies not started yet instead of running them."""
        self._writer.shutdown(wait=wait, cancel_futures=not wait)
        self._reader.shutdown(wait=wait, cancel_futures=not wait)

    def _offload_sync(self, job_id: str, indices: list[int], data: torch.Tensor,
                      item: _Unstored) -> bool:
        t0 = time.perf_counter()
        ok = True
        try:
            if item.dropped:  # nobody wants this copy any more
                self.stats.offloads_skipped += 1
                return True
            if item.ready is not None:  # a device copy still in flight
                item.ready()
            ok = self._put(job_id, item.blocks)
        except Exception as e:  # the directory is gone: a refused offload
            log.warning("offload of %s failed: %r", job_id, e)
            ok = False
        finally:
            with self._lock:
                self._pending -= len(indices)
                items = self._unstored.get(job_id)
                if items is not None and item in items:
                    items.remove(item)
                    if not items:
                        del self._unstored[job_id]
        self.stats.swap_out_s += time.perf_counter() - t0
        if ok:
            self.stats.offloads += 1
            self.stats.bytes_offloaded += data.numel() * data.element_size()
        else:
            self.stats.offload_failures += 1
        return ok

    def _fetch_sync(self, job_id: str, indices: list[int], pinned: bool,
                    local: dict[int, tuple[torch.Tensor, Callable[[], None] | None]]
                    ) -> torch.Tensor | None:
        t0 = time.perf_counter()
        rest = [i for i in indices if i not in local]
        try:
            # Each offload's device copy that may still be filling its blocks, once.
            for ready in {id(r): r for _, r in local.values() if r is not None}.values():
                ready()
            stored = self._get(job_id, rest) if rest else []
        except Exception as e:  # the directory is gone: the blocks are lost
            log.warning("fetch of %s failed: %r", job_id, e)
            stored = None
        self.stats.swap_in_s += time.perf_counter() - t0
        if stored is None:
            self.stats.fetch_failures += 1
            return None
        by_index = dict(zip(rest, stored))
        got = [local[i][0] if i in local else by_index[i] for i in indices]
        if pinned:
            # Stacked straight into page-locked memory: the swap-in's copy
            # to the GPU then needs no staging and no wait on the host.
            out = torch.empty((len(got), *got[0].shape), dtype=got[0].dtype, pin_memory=True)
            torch.stack(got, out=out)
        else:
            out = torch.stack(got)
        self.stats.fetches += 1
        self.stats.blocks_fetched_unstored += len(local)
        self.stats.bytes_fetched += out.numel() * out.element_size()
        return out

    def _drop_sync(self, job_id: str) -> None:
        try:
            self._remove(job_id)
        except Exception as e:  # nothing left to free
            log.warning("drop of %s failed: %r", job_id, e)

    @abstractmethod
    def _put(self, job_id: str, blocks: dict[int, torch.Tensor]) -> bool: ...

    @abstractmethod
    def _get(self, job_id: str, indices: list[int]) -> list[torch.Tensor] | None: ...

    @abstractmethod
    def _remove(self, job_id: str) -> None: ...

    @abstractmethod
    def _held(self, job_id: str) -> int: ...


class LocalHostTier(ThreadedHostTier):
    def __init__(self, capacity_bytes: int) -> None:
        super().__init__()
        self.capacity = capacity_bytes
        self.used = 0
        self._store: dict[str, dict[int, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def _put(self, job_id: str, blocks: dict[int, torch.Tensor]) -> bool:
        size = sum(t.numel() * t.element_size() for t in blocks.values())
        with self._lock:
            if self.used + size > self.capacity:
                return False
            entry = self._store.setdefault(job_id, {})
            for i, t in blocks.items():
                if i in entry:
                    self.used -= entry[i].numel() * entry[i].element_size()
                entry[i] = t.clone()
            self.used += size
        return True

    def _get(self, job_id: str, indices: list[int]) -> list[torch.Tensor] | None:
        with self._lock:
            entry = self._store.get(job_id)
            if entry is None or any(i not in entry for i in indices):
                return None
            return [entry[i] for i in indices]

    def _remove(self, job_id: str) -> None:
        with self._lock:
            for t in self._store.pop(job_id, {}).values():
                self.used -= t.numel() * t.element_size()

    def _held(self, job_id: str) -> int:
        with self._lock:
            return leading_blocks(self._store.get(job_id, {}))


class ObjectStoreTier(ThreadedHostTier):
    """Blocks in Ray's object store, owned by a `KVDirectory` actor.

    With `name`, the directory is looked up again by name when the handle
    stops working: a restarted Scheduler replica creates a new directory of
    the same name, and this replica goes on with it (the old one's blocks
    are lost with it, which the scheduler treats as a lost fetch)."""

    def __init__(self, directory: Any, name: str | None = None,
                 namespace: str | None = None, owner: str | None = None) -> None:
        super().__init__()
        from kvstore.directory import DIRECTORY_NAMESPACE

        self.directory = directory
        self.name = name
        self.namespace = namespace or DIRECTORY_NAMESPACE
        # The engine replica whose share of the directory this tier fills.
        self.owner = owner

    def _call(self, method: str, *args: Any) -> Any:
        import ray
        from ray.exceptions import RayActorError

        try:
            return ray.get(getattr(self.directory, method).remote(*args))
        except RayActorError:
            if self.name is None:
                raise
            self.directory = ray.get_actor(self.name, namespace=self.namespace)
            return ray.get(getattr(self.directory, method).remote(*args))

    def _put(self, job_id: str, blocks: dict[int, torch.Tensor]) -> bool:
        # numpy views travel zero-copy through the object store; bf16 has
        # no numpy dtype, so blocks go as raw bytes with dtype and shape.
        payload = {i: _to_wire(t) for i, t in blocks.items()}
        return bool(self._call("put", job_id, payload, self.owner))

    def _get(self, job_id: str, indices: list[int]) -> list[torch.Tensor] | None:
        import ray

        wrapped = self._call("get_refs", job_id, indices)
        if wrapped is None:
            return None
        return [_from_wire(a) for a in ray.get([w[0] for w in wrapped])]

    def _remove(self, job_id: str) -> None:
        # Fire and forget: the directory applies it in order after this
        # replica's earlier puts.
        self.directory.drop.remote(job_id)

    def _held(self, job_id: str) -> int:
        return int(self._call("held", job_id))


def _to_wire(t: torch.Tensor) -> Wire:
    t = t.detach().to("cpu").contiguous()
    raw = t.view(torch.uint8).reshape(-1) if t.element_size() > 0 else t
    return Wire(raw.numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape))


def _from_wire(w: Wire) -> torch.Tensor:
    raw = torch.from_numpy(w.data.copy())
    return raw.view(getattr(torch, w.dtype)).reshape(w.shape)
