"""An unexpected exception still answers OpenAI's JSON error, never
Starlette's plain-text 500, and never leaks the exception's text."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from api.http import JSONServerErrors
from tests.api.harness import Harness
from tests.api.shapes import assert_error


@pytest.fixture
def broken_scheduler(served: Harness) -> Iterator[Harness]:
    real = served.scheduler.admit

    class Broken:
        def remote(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("secret internal detail")

    served.scheduler.admit = Broken()  # type: ignore[assignment]
    try:
        yield served
    finally:
        served.scheduler.admit = real


def test_unexpected_exception_is_a_json_500(broken_scheduler: Harness) -> None:
    r = broken_scheduler.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 500
    body = r.json()
    assert body == {"error": {"message": "internal server error", "type": "server_error",
                              "param": None, "code": 500}}
    assert "secret" not in r.text


def test_an_exception_after_the_stream_started_propagates() -> None:
    # Nothing valid can be sent once the status is out: the server must see it.
    async def events() -> Any:
        yield "data: 1\n\n"
        raise RuntimeError("mid-stream")

    async def endpoint(request: Any) -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    app = JSONServerErrors(Starlette(routes=[Route("/s", endpoint)]))
    with TestClient(app) as client, pytest.raises(RuntimeError, match="mid-stream"):
        client.get("/s")


def test_non_http_scopes_pass_through() -> None:
    seen: list[str] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    asyncio.run(JSONServerErrors(inner)({"type": "lifespan"}, None, None))  # type: ignore[arg-type]
    assert seen == ["lifespan"]


def test_plain_starlette_errors_become_json(served: Harness) -> None:
    assert_error(served.client.get("/missing"), 404)
    assert_error(served.client.post("/health"), 405)


@pytest.mark.parametrize("live", [0, None], ids=["no-engine-yet", "scheduler-silent"])
def test_health_is_503_until_an_engine_serves(served: Harness, live: int | None) -> None:
    # The ingress starts before the engines load their models: a 200 then
    # would send a client's first requests to wait for the whole start.
    served.scheduler.live_engines = live
    try:
        r = served.client.get("/health")
        assert r.status_code == 503 and r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert err["code"] == 503 and err["type"] == "service_unavailable"
        assert r.headers["retry-after"] == "1"
        assert ("no engine replica is serving yet" if live == 0
                else "the scheduler does not answer") in err["message"]
        assert served.client.head("/health").status_code == 503
    finally:
        served.scheduler.live_engines = 1
    assert served.client.get("/health").status_code == 200


class _ClientGone(Exception):
    pass


def test_a_client_disconnect_mid_stream_is_logged_as_one(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # Ray Serve cancels the request's task when its client goes away; the
    # stream then fails with that cancellation, which is no server error.
    async def events() -> Any:
        yield "data: 1\n\n"
        raise _ClientGone()

    async def endpoint(request: Any) -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    import logging

    import api.http

    # Ray's own logger does not propagate to pytest's capture.
    monkeypatch.setattr(api.http, "log", logging.getLogger("tests.api.server_errors"))
    app = JSONServerErrors(Starlette(routes=[Route("/s", endpoint)]),
                           disconnected=(_ClientGone,))
    with caplog.at_level("INFO", logger="tests.api.server_errors"), TestClient(app) as client:
        r = client.get("/s")
    assert r.status_code == 200 and r.text == "data: 1\n\n"
    assert any("client disconnected during GET /s" in m for m in caplog.messages)
    assert not [rec for rec in caplog.records if rec.levelname == "ERROR"]
    # Any other exception is still an unhandled error.
    plain = JSONServerErrors(Starlette(routes=[Route("/s", endpoint)]))
    with TestClient(plain) as client, pytest.raises(_ClientGone):
        client.get("/s")
