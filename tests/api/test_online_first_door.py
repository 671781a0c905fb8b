"""The Ingress's door (deployments/online_first.py) as the routes use it: an
online request starts while offline ones wait, offline ones start
`offline_starts` at a time, by priority, and a batch line waits like them."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.api.harness import _Method, admit_each, harness, settle_until


class PooledScheduler:
    """Admits online requests at once and holds offline ones, as the offline
    pool does while no replica has room, until `pool_open` is set."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pool_open = asyncio.Event()
        # (request id, job class) in the order admission was asked.
        self.asked: list[tuple[str, str]] = []
        self.admit = _Method(self._admit)
        self.release = inner.release
        self.ready = inner.ready
        self.admit_many = admit_each(self)
        self.release_many = inner.release_many

    async def _admit(self, request_id: str, prompt_tokens: int, max_tokens: int,
                     job_class: str = "online", *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.asked.append((request_id, job_class))
        if job_class == "offline":
            await self.pool_open.wait()
        return await self.inner.admit.remote(request_id, prompt_tokens, max_tokens,
                                             job_class, *args, **kwargs)


def test_online_starts_while_offline_waits_and_offline_go_in_by_priority() -> None:
    with harness(offline_starts=1) as h:
        pool = PooledScheduler(h.ingress.scheduler)
        h.ingress.scheduler = pool

        async def run() -> None:
            transport = httpx.ASGITransport(app=h.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                def offline(prompt: str, priority: int) -> "asyncio.Task[httpx.Response]":
                    return asyncio.get_running_loop().create_task(c.post(
                        "/v1/completions", json={"prompt": prompt, "max_tokens": 3,
                                                 "job_class": "offline",
                                                 "priority": priority}))

                first = offline("first", 0)
                await settle_until(lambda: len(pool.asked) == 1, "the first offline admission")
                later = offline("later", 3)
                urgent = offline("urgent", -1)
                line = asyncio.get_running_loop().create_task(h.ingress.batch_request(
                    "/v1/completions", {"prompt": "a batch line", "max_tokens": 3}))
                await asyncio.sleep(0.2)
                # Three offline requests wait at the door; none asked admission.
                assert len(pool.asked) == 1
                online = await c.post("/v1/completions",
                                      json={"prompt": "hello", "max_tokens": 3})
                assert online.status_code == 200, online.text
                assert [k for _, k in pool.asked] == ["offline", "online"]
                pool.pool_open.set()
                done = await asyncio.gather(first, later, urgent)
                assert [r.status_code for r in done] == [200, 200, 200]
                out = await line
                assert out["status_code"] == 200, out
                ids = [r.json()["id"] for r in done]
                order = [rid for rid, _ in pool.asked]
                # Then the urgent one (priority -1), the batch line (0),
                # the later one (3).
                assert order[0] == ids[0] and order[2] == ids[2]
                assert order[3] == out["request_id"] and order[4] == ids[1]
                assert (h.ingress.door.offline_starting, h.ingress.door.online_starting,
                        h.ingress.door.offline_waiting) == (0, 0, 0)

        asyncio.run(asyncio.wait_for(run(), 60))
