"""The ingress sends an online request to the replica the Scheduler's last
answer foresaw, beside its admission call (deployments/dispatch_ahead.py):
the engine has it before the answer; admitted, the client gets the answer
from that one stream; refused, the early stream is cancelled and the client
gets the 429."""

from __future__ import annotations

import asyncio

import httpx

from tests.api.harness import harness, settle_until
from tests.api.test_scheduler_calls import GatedScheduler


def _post(c: httpx.AsyncClient, stream: bool) -> "asyncio.Task[httpx.Response]":
    return asyncio.get_running_loop().create_task(c.post(
        "/v1/completions", json={"prompt": "hello", "max_tokens": 3, "stream": stream}))


def test_the_engine_has_the_request_before_its_admission_answer() -> None:
    with harness() as h:
        h.scheduler.ahead = "r1"
        gated = GatedScheduler(h.ingress.scheduler)
        h.ingress.scheduler = gated

        async def run() -> None:
            transport = httpx.ASGITransport(app=h.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                # The first answer is the first foresight: sent after it.
                first = _post(c, False)
                await settle_until(lambda: len(gated.calls) == 1, "the first admission call")
                assert len(h.engine.requests) == 0
                gated.gate.set()
                assert (await first).status_code == 200
                for stream in (False, True):
                    sent = len(h.engine.requests)
                    nxt = _post(c, stream)
                    await settle_until(lambda: len(h.engine.requests) == sent + 1,
                                       "the request at the engine, its answer held")
                    assert not gated.gate.is_set()
                    gated.gate.set()
                    r = await nxt
                    assert r.status_code == 200
                    if not stream:
                        assert r.json()["choices"][0]["finish_reason"] == "length"
                    else:
                        assert r.text.rstrip().endswith("data: [DONE]")
                    assert len(h.engine.requests) == sent + 1  # one stream, kept
                assert h.ingress._ahead.num_kept == 2 and h.ingress._ahead.num_cancelled == 0

        asyncio.run(asyncio.wait_for(run(), 60))


def test_a_refused_request_sent_ahead_is_cancelled_at_the_engine() -> None:
    with harness() as h:
        h.scheduler.ahead = "r1"
        assert h.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}
                             ).status_code == 200
        h.scheduler.reject = True
        sent = len(h.engine.requests)
        r = h.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["Retry-After"] == "2"
        assert len(h.engine.requests) == sent + 1 and h.engine.streams[-1].cancelled
        assert h.ingress._ahead.num_cancelled == 1
        # The refusal turned the foresight off: the next request waits for its answer.
        r = h.client.post("/v1/completions", json={"prompt": "again", "max_tokens": 2})
        assert r.status_code == 429 and len(h.engine.requests) == sent + 1
