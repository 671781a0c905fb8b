"""The ingress's calls to the Scheduler (deployments/coalesce.py): online
requests that arrive while an admission call is in flight are admitted
together in the next call, their releases likewise; a request whose client
went away while its admission was asked is released, not left admitted."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.api.harness import _Method, harness, settle_until


class GatedScheduler:
    """The harness's scheduler, with each `admit_many` call held until
    the test opens `gate` (then closed again for the next call)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.calls: list[list[str]] = []
        self.release_calls: list[list[tuple[str, str]]] = []
        self.admit, self.release, self.ready = inner.admit, inner.release, inner.ready
        self.admit_many = _Method(self._admit_many)
        self.release_many = _Method(self._release_many)

    async def _admit_many(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.calls.append([r["request_id"] for r in requests])
        await self.gate.wait()
        self.gate.clear()
        return await self.inner.admit_many.remote(requests)

    async def _release_many(self, releases: list[tuple[str, str]]) -> None:
        self.release_calls.append(list(releases))
        await self.inner.release_many.remote(releases)


def test_arrivals_during_an_admission_call_are_admitted_in_the_next() -> None:
    with harness() as h:
        gated = GatedScheduler(h.ingress.scheduler)
        h.ingress.scheduler = gated

        async def run() -> None:
            transport = httpx.ASGITransport(app=h.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                def post(i: int) -> "asyncio.Task[httpx.Response]":
                    return asyncio.get_running_loop().create_task(c.post(
                        "/v1/completions", json={"prompt": f"request {i}", "max_tokens": 2,
                                                 "stream": i % 2 == 0}))

                first = post(0)
                await settle_until(lambda: len(gated.calls) == 1, "the first admission call")
                rest = [post(i) for i in range(1, 9)]
                await settle_until(lambda: h.ingress._admits.num_items == 1
                              and len(h.ingress._admits._pending) == 8, "eight waiting")
                gated.gate.set()
                await settle_until(lambda: len(gated.calls) == 2, "the second admission call")
                gated.gate.set()
                done = await asyncio.gather(first, *rest)
                assert [r.status_code for r in done] == [200] * 9
                ids = [r.json()["id"] for r in done[1::2]]
                assert len(gated.calls[1]) == 8 and set(ids) <= set(gated.calls[1])
                await settle_until(lambda: len(h.scheduler.released) >= 9, "nine releases")
                # Ended together: fewer release calls than requests.
                assert len(gated.release_calls) < 9
                assert {rid: h.scheduler.released[rid] for c_ in gated.calls for rid in c_} \
                    == {rid: "finished" for c_ in gated.calls for rid in c_}

        asyncio.run(asyncio.wait_for(run(), 60))


def test_a_client_gone_while_its_admission_was_asked_is_released() -> None:
    with harness() as h:
        gated = GatedScheduler(h.ingress.scheduler)
        h.ingress.scheduler = gated
        sent = len(h.engine.requests)

        async def run() -> None:
            transport = httpx.ASGITransport(app=h.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                gone = asyncio.get_running_loop().create_task(c.post(
                    "/v1/completions", json={"prompt": "hello", "max_tokens": 2}))
                await settle_until(lambda: len(gated.calls) == 1, "its admission call")
                gone.cancel()
                await asyncio.sleep(0.05)
                gated.gate.set()  # admitted after its client left
                rid = gated.calls[0][0]
                await settle_until(lambda: rid in h.scheduler.released, "its release")
                assert h.scheduler.released[rid] == "aborted"

        asyncio.run(asyncio.wait_for(run(), 60))
        assert len(h.engine.requests) == sent  # it never reached an engine
