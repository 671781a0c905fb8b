"""Host KV tiers: the engine's `HostKVTier` (engine/swapper.py) implemented.

Copies never run on the iteration's critical path: in a `ThreadedHostTier`
offloads and fetches go to one worker thread (FIFO, so a fetch after an
offload of the same job sees it) and the runner polls for fetches that have
landed.

- `LocalHostTier`: host memory of this process (tests, single replica
  without Ray).
- `ObjectStoreTier`: Ray's object store through the application's
  `KVDirectory` (kvstore/directory.py), so blocks survive the replica.

A copy that fails (the directory went away with its application, or is
being replaced) counts as a refused offload or a lost fetch, never as an
exception on the worker thread: the scheduler already handles both.
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.swapper import HostKVTier
from kvstore.held import leading_blocks

log = logging.getLogger(__name__)


@dataclass
class TierStats:
    offloads: int = 0
    fetches: int = 0
    bytes_offloaded: int = 0
    bytes_fetched: int = 0
    fetch_failures: int = 0
    offload_failures: int = 0
    swap_out_s: float = 0.0
    swap_in_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class ThreadedHostTier(HostKVTier, ABC):
    """A `HostKVTier` whose copies run on one worker thread; a subclass
    says where the blocks are kept (`_put`, `_get`, `_remove`)."""

    def __init__(self) -> None:
        self.stats = TierStats()
        # One thread: FIFO order across offload / fetch / drop.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier")
        self._landed: queue.SimpleQueue[tuple[str, torch.Tensor | None]] = queue.SimpleQueue()
        # Blocks handed to `offload` and not stored yet: a replica that dies
        # loses them (`pending_blocks`).
        self._pending = 0
        self._pending_lock = threading.Lock()

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
        with self._pending_lock:
            self._pending += len(indices)
        return self._pool.submit(self._offload_sync, job_id, indices, data, ready)

    def fetch(self, job_id: str, indices: list[int],
              pinned: bool = False) -> Future[torch.Tensor | None]:
        fut = self._pool.submit(self._fetch_sync, job_id, indices, pinned)

        def landed(f: Future[torch.Tensor | None]) -> None:
            # Cancelled by close(): nobody polls any more.
            if not f.cancelled():
                self._landed.put((job_id, None if f.exception() else f.result()))

        fut.add_done_callback(landed)
        return fut

    def drop(self, job_id: str) -> None:
        self._pool.submit(self._drop_sync, job_id)

    def held(self, job_id: str) -> int:
        """How many of `job_id`'s blocks, from block 0 on without a gap, the
        tier holds, once the copies queued before have run: the checkpoint
        a job resumes from on another replica (`survival.checkpoint`)."""
        try:
            return self._pool.submit(self._held, job_id).result()
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
        self._pool.submit(lambda: None).result()

    def close(self, wait: bool = True) -> None:
        """Stop the worker thread.  `wait=False` (replica shutdown) drops
        the copies not started yet instead of running them."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

    def _offload_sync(self, job_id: str, indices: list[int], data: torch.Tensor,
                      ready: Callable[[], None] | None = None) -> bool:
        import time

        t0 = time.perf_counter()
        try:
            if ready is not None:  # a device copy still in flight
                ready()
            ok = self._put(job_id, dict(zip(indices, data.unbind(0))))
        except Exception as e:  # the directory is gone: a refused offload
            log.warning("offload of %s failed: %r", job_id, e)
            ok = False
        with self._pending_lock:
            self._pending -= len(indices)
        self.stats.swap_out_s += time.perf_counter() - t0
        if ok:
            self.stats.offloads += 1
            self.stats.bytes_offloaded += data.numel() * data.element_size()
        else:
            self.stats.offload_failures += 1
        return ok

    def _fetch_sync(self, job_id: str, indices: list[int],
                    pinned: bool = False) -> torch.Tensor | None:
        import time

        t0 = time.perf_counter()
        try:
            got = self._get(job_id, indices)
        except Exception as e:  # the directory is gone: the blocks are lost
            log.warning("fetch of %s failed: %r", job_id, e)
            got = None
        self.stats.swap_in_s += time.perf_counter() - t0
        if got is None:
            self.stats.fetch_failures += 1
            return None
        if pinned:
            # Stacked straight into page-locked memory: the swap-in's copy
            # to the GPU then needs no staging and no wait on the host.
            out = torch.empty((len(got), *got[0].shape), dtype=got[0].dtype, pin_memory=True)
            torch.stack(got, out=out)
        else:
            out = torch.stack(got)
        self.stats.fetches += 1
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


class _Wire:
    __slots__ = ("data", "dtype", "shape", "nbytes")

    def __init__(self, data: Any, dtype: str, shape: tuple[int, ...]) -> None:
        self.data = data
        self.dtype = dtype
        self.shape = shape
        self.nbytes = data.nbytes

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_Wire, (self.data, self.dtype, self.shape))


def _to_wire(t: torch.Tensor) -> _Wire:
    t = t.detach().to("cpu").contiguous()
    raw = t.view(torch.uint8).reshape(-1) if t.element_size() > 0 else t
    return _Wire(raw.numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape))


def _from_wire(w: _Wire) -> torch.Tensor:
    raw = torch.from_numpy(w.data.copy())
    return raw.view(getattr(torch, w.dtype)).reshape(w.shape)
