"""deployments/coalesce.py: calls made while one is in flight go in the
next, a lone call waits for nothing, and every caller gets its own answer,
the batch's error, or (gone meanwhile) its answer goes to `orphan`."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from deployments.coalesce import Coalescer


class Remote:
    """A `send` whose calls wait until the test opens them, one at a time."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.gate = asyncio.Event()
        self.fail: Exception | None = None

    async def send(self, items: list[int]) -> list[int]:
        self.calls.append(list(items))
        await self.gate.wait()
        self.gate.clear()
        if self.fail is not None:
            raise self.fail
        return [i * 10 for i in items]


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_calls_made_while_one_is_in_flight_go_together_in_the_next() -> None:
    async def run() -> None:
        r = Remote()
        c: Coalescer[int, int] = Coalescer(r.send)
        first = c.submit(1)
        await _turns()
        assert r.calls == [[1]]  # sent alone, at once
        rest = [c.submit(i) for i in range(2, 7)]
        await _turns()
        assert r.calls == [[1]]  # waiting for the first to come back
        r.gate.set()
        assert await first == 10
        await _turns()
        assert r.calls == [[1], [2, 3, 4, 5, 6]]
        r.gate.set()
        assert await asyncio.gather(*rest) == [20, 30, 40, 50, 60]
        assert (c.num_calls, c.num_items) == (2, 6)
        # Idle again: the next call goes at once.
        later = c.submit(7)
        await _turns()
        assert r.calls[-1] == [7]
        r.gate.set()
        assert await later == 70

    asyncio.run(run())


def test_a_batch_is_at_most_max_items() -> None:
    async def run() -> None:
        r = Remote()
        c: Coalescer[int, int] = Coalescer(r.send, max_items=2)
        futs = [c.submit(i) for i in range(5)]
        for _ in range(3):
            await _turns()
            r.gate.set()
        assert await asyncio.gather(*futs) == [0, 10, 20, 30, 40]
        assert r.calls == [[0, 1], [2, 3], [4]]

    asyncio.run(run())


def test_an_error_is_every_caller_of_its_batch_and_the_next_batch_still_goes() -> None:
    async def run() -> None:
        r = Remote()
        c: Coalescer[int, int] = Coalescer(r.send)
        a, b = c.submit(1), c.submit(2)
        r.fail = RuntimeError("scheduler died")
        await _turns()
        r.gate.set()
        for f in (a, b):
            with pytest.raises(RuntimeError, match="scheduler died"):
                await f
        r.fail = None
        d = c.submit(3)
        await _turns()
        r.gate.set()
        assert await d == 30

    asyncio.run(run())


def test_a_wrong_number_of_answers_fails_the_batch() -> None:
    async def run() -> None:
        async def short(items: list[int]) -> list[int]:
            return items[:1]

        c: Coalescer[int, int] = Coalescer(short)
        a, b = c.submit(1), c.submit(2)
        for f in (a, b):
            with pytest.raises(RuntimeError, match="1 answers to 2 items"):
                await f

    asyncio.run(run())


def test_a_caller_gone_before_sending_drops_its_item_and_after_gets_orphan() -> None:
    async def run() -> None:
        r = Remote()
        orphans: list[tuple[int, int]] = []
        c: Coalescer[int, int] = Coalescer(r.send, orphan=lambda i, res: orphans.append((i, res)))
        first = c.submit(1)
        await _turns()
        dropped, kept = c.submit(2), c.submit(3)
        dropped.cancel()  # before its batch was sent
        first.cancel()  # after: the answer comes back to nobody
        r.gate.set()
        await _turns()
        assert r.calls == [[1], [3]]
        assert orphans == [(1, 10)]
        r.gate.set()
        assert await kept == 30

    asyncio.run(run())


def test_the_calls_run_outside_the_submitters_context() -> None:
    request = contextvars.ContextVar("request", default="none")
    seen: list[str] = []

    async def send(items: list[int]) -> list[int]:
        seen.append(request.get())
        return items

    async def run() -> None:
        request.set("request-1")
        c: Coalescer[int, int] = Coalescer(send)
        assert await c.submit(5) == 5

    asyncio.run(run())
    assert seen == ["none"]
