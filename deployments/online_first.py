"""The Ingress's door: online requests start first, offline ones a few at a time.

Starting a request costs the Ingress a few milliseconds of CPU, nearly all
of it Ray Serve's handle calls (the Scheduler's admission, the engine's
stream) and the tokenizer, and costs the Scheduler its admission.  Started
together, a burst of offline HTTP requests shares the Ingress's event loop
and router thread with every online request that arrives behind it: 300
offline completions at once delayed the first token of an online request
sent 50 ms later by 1.8 s on a 2-core host
(`studies/conserve_live/offline_burst.py`), although the engine serves that
online request before any offline work (ConServe §4.1: online work never
queues behind offline).  The door keeps that promise in the Ingress too: at
most `offline_starts` offline requests start at once, and none while an
online request is starting; the others wait here, costing nothing.  Online
requests never wait.  Only the start is gated: once its engine stream is
open, an offline request streams as any other.

An offline request holds its place while it waits for admission in the
Scheduler's offline pool (`policy: conserve`): giving the place up there
let the whole burst through to the Scheduler at once and undid the gain
(measured in the study above).  So the door orders its waiters as the pool
orders its own, lower `priority` first, then arrival: the pool sees the
door's best, and a request of a more urgent priority overtakes at most the
`offline_starts` requests already in the pool.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class OnlineFirstDoor:
    def __init__(self, offline_starts: int) -> None:
        if offline_starts < 1:
            raise ValueError("offline_starts must be >= 1")
        self.offline_starts = offline_starts
        self.online_starting = 0
        self.offline_starting = 0
        # (priority, arrival, turn): the door's waiting offline requests.
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @property
    def offline_waiting(self) -> int:
        return sum(not turn.done() for _, _, turn in self._waiting)

    @asynccontextmanager
    async def start(self, offline: bool, priority: int = 0) -> AsyncIterator[None]:
        """Hold the door while a request starts; `priority` orders offline
        requests that wait (lower first)."""
        if not offline:
            self.online_starting += 1
            try:
                yield
            finally:
                self.online_starting -= 1
                self._let_in()
            return
        await self._enter(priority)
        try:
            yield
        finally:
            self.offline_starting -= 1
            self._let_in()

    def _open(self) -> bool:
        return self.online_starting == 0 and self.offline_starting < self.offline_starts

    async def _enter(self, priority: int) -> None:
        if self._open() and not self._waiting:
            self.offline_starting += 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._arrivals), turn))
        try:
            await turn
        except asyncio.CancelledError:
            # A client that hung up after its turn was given hands it on.
            if turn.done() and not turn.cancelled():
                self.offline_starting -= 1
                self._let_in()
            raise

    def _let_in(self) -> None:
        while self._waiting and self._open():
            _, _, turn = heapq.heappop(self._waiting)
            if turn.done():  # its client hung up while waiting
                continue
            self.offline_starting += 1
            turn.set_result(None)
