"""One handle call for many: calls to a deployment that arrive while the
previous one is in flight go together in the next.

Each Serve handle call costs the caller and the callee about a millisecond
of CPU each (routing, serialization, the replica's request wrapper), on the
core the engine leaves to everything else. When a burst arrives, the
ingress's per-request calls to the Scheduler (admit, release) queue behind
one another on that core, and the engine runs small iterations until the
burst has reached it (studies/burst/README.md, "How fast a burst reaches the
engine"). A `Coalescer` sends the first call at once, so a lone request
waits for nothing, and every call made while it is in flight in the next
one: as many Serve calls as round trips, not as requests.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Coalescer(Generic[T, R]):
    """`submit(item)` is a future of `send([..., item, ...])`'s answer for
    it. `send` gets the items submitted since its previous call (at most
    `max_items`) and answers one result per item, in order; an exception
    it raises is every waiting caller's. A caller that stops waiting before
    its item is sent drops the item; after, `orphan(item, result)` gets
    the answer nobody awaits (e.g. to undo an admission)."""

    def __init__(self, send: Callable[[list[T]], Awaitable[list[R]]],
                 orphan: Callable[[T, R], None] | None = None, max_items: int = 512) -> None:
        self._send = send
        self._orphan = orphan
        self._max_items = max_items
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._task: asyncio.Task[None] | None = None
        # Handle calls made and items they carried (tests, studies).
        self.num_calls = 0
        self.num_items = 0

    def submit(self, item: T) -> asyncio.Future[R]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        self._pending.append((item, fut))
        if self._task is None:
            # A fresh context: the calls belong to no one request, and under
            # a request's Serve context they would carry its id and be
            # cancelled with it (Ingress._detached says why that matters).
            self._task = loop.create_task(self._drain(), context=contextvars.Context())
        return fut

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch = self._pending[:self._max_items]
                del self._pending[:self._max_items]
                live = [(item, fut) for item, fut in batch if not fut.done()]
                if live:
                    await self._call(live)
        except asyncio.CancelledError:
            for _, fut in self._pending:
                fut.cancel()
            self._pending.clear()
            raise
        finally:
            self._task = None

    async def _call(self, live: list[tuple[T, asyncio.Future[R]]]) -> None:
        self.num_calls += 1
        self.num_items += len(live)
        try:
            results = await self._send([item for item, _ in live])
            if len(results) != len(live):
                raise RuntimeError(f"{len(results)} answers to {len(live)} items")
        except asyncio.CancelledError:
            for _, fut in live:
                fut.cancel()
            raise
        except Exception as e:  # every caller of this batch gets it
            for _, fut in live:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (item, fut), result in zip(live, results):
            if not fut.done():
                fut.set_result(result)
            elif self._orphan is not None:  # its caller went away meanwhile
                self._orphan(item, result)
