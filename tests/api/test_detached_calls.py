"""Calls the ingress makes beside a request's engine stream (the length
prediction it forwards, the Scheduler release) run outside the request's
Serve context: under it they would share the stream's internal request id,
and Serve's request router, which indexes a call being routed by that id,
would never route the second of two such calls pending at once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ray.serve import context as serve_context

from tests.api.harness import harness


class _Predict:
    """`predictor.predict` of a fake Predictor handle."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.predict = self

    def remote(self, prompt: str) -> Any:
        self.prompts.append(prompt)

        async def answer() -> dict[str, int]:
            return {"predicted_len": 7, "allocation": 9}

        return answer()


def test_a_detached_call_has_no_request_context_and_leaves_the_callers() -> None:
    seen: list[str] = []

    async def call() -> None:
        seen.append(serve_context._get_serve_request_context()._internal_request_id)

    async def run(ingress: Any) -> str:
        serve_context._serve_request_context.set(
            serve_context._RequestContext(_internal_request_id="request-1"))
        ingress._detached(call)
        await asyncio.gather(*ingress._background)
        return serve_context._get_serve_request_context()._internal_request_id

    with harness() as h:
        outer = asyncio.run(run(h.ingress))
    # A fresh context: Serve gives the call an id of its own.
    assert seen == [""]
    assert outer == "request-1"


def test_a_landed_prediction_reaches_the_engine_replica_of_its_request() -> None:
    with harness() as h:
        predictor = h.ingress.predictor = _Predict()
        calls: list[tuple[str, int, Any, Any]] = []

        async def set_prediction(request_id: str, predicted_len: int,
                                 replica: str | None = None,
                                 allocation: int | None = None) -> None:
            calls.append((request_id, predicted_len, replica, allocation))

        h.engine.set_prediction.remote = set_prediction  # type: ignore[method-assign]
        r = h.client.post("/v1/completions", json={"prompt": "Say hi", "max_tokens": 4})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
    assert predictor.prompts == ["Say hi"]
    # The fake Scheduler places nothing (replica None); the engine learns
    # the length and the padded allocation for the request it runs.
    assert calls == [(r.json()["id"], 7, None, 9)]
