"""`background: true` Responses (`deployments/responses_background.py`):
answered at once, polled to the end, cancelled here or through the store's
mark (as from another replica), a refusal for load waited out, a runner
that went silent read as failed, and what cannot be backgrounded refused."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
from openai import OpenAI

from api.responses_store import StoredResponse
from tests.api.harness import Harness, harness

pytest.importorskip("xgrammar")


@pytest.fixture
def h(wide: Harness) -> Any:
    yield wide
    wide.engine.state.paused = False
    wide.engine.state.free_wakeups = 0
    wide.scheduler.reject = False


def _post(h: Harness, **body: Any) -> Any:
    return h.client.post("/v1/responses", json={"model": h.model_name, "max_output_tokens": 64,
                                                "input": "Hi", **body})


def _poll(h: Harness, rid: str, done: Callable[[dict[str, Any]], bool],
          timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        body = h.client.get(f"/v1/responses/{rid}").json()
        if done(body) or time.monotonic() > deadline:
            return body
        time.sleep(0.01)


def _ended(body: dict[str, Any]) -> bool:
    return body["status"] not in ("queued", "in_progress")


def test_a_background_response_is_answered_at_once_and_polled_to_its_end(h: Harness) -> None:
    h.engine.state.answer = "Done later."
    h.engine.state.paused = True
    r = _post(h, background=True)
    assert r.status_code == 200, r.text
    queued = r.json()
    assert (queued["status"], queued["background"], queued["store"]) == ("queued", True, True)
    assert queued["output"] == []
    running = _poll(h, queued["id"], lambda b: b["status"] == "in_progress")
    assert running["status"] == "in_progress"
    h.engine.state.paused = False
    done = _poll(h, queued["id"], _ended)
    assert done["status"] == "completed" and done["background"] is True
    assert done["output"][0]["content"][0]["text"] == "Done later."
    assert done["usage"]["output_tokens"] > 0
    # The client's own reading, and a follow-up that continues it.
    client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=h.client)
    assert client.responses.retrieve(queued["id"]).output_text == "Done later."
    follow = _post(h, input="More?", previous_response_id=queued["id"])
    assert follow.status_code == 200
    prompt = h.engine.state.tokenizer.decode(h.engine.requests[-1].prompt_token_ids)
    assert "Done later." in prompt


def test_cancel_stops_the_engine_and_says_cancelled(h: Harness) -> None:
    h.engine.state.answer = "Never finished."
    h.engine.state.paused = True
    rid = _post(h, background=True).json()["id"]
    _poll(h, rid, lambda b: b["status"] == "in_progress")
    stream = h.engine.streams[-1]
    r = h.client.post(f"/v1/responses/{rid}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    assert stream.cancelled
    request_id = h.engine.requests[-1].request_id
    assert h.scheduler.released[request_id] == "aborted"  # its KV let go
    assert h.client.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"
    # Cancelling again returns it as it is; a response not made in the
    # background cannot be cancelled.
    assert h.client.post(f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"
    h.engine.state.paused = False
    plain = _post(h).json()["id"]
    bad = h.client.post(f"/v1/responses/{plain}/cancel")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_id"
    assert h.client.post("/v1/responses/resp_nope/cancel").status_code == 404


def test_a_cancelled_response_keeps_what_it_had_written(h: Harness) -> None:
    h.engine.state.answer = "One two three four five six seven eight."
    h.engine.state.paused, h.engine.state.free_wakeups = True, 3  # three tokens, then held
    rid = _post(h, background=True).json()["id"]
    _poll(h, rid, lambda b: b["status"] == "in_progress")
    time.sleep(0.2)  # the three free tokens are read
    body = h.client.post(f"/v1/responses/{rid}/cancel").json()
    tok = h.engine.state.tokenizer
    first = tok.decode(tok.encode(h.engine.state.answer, add_special_tokens=False)[:3])
    assert body["status"] == "cancelled" and body["usage"]["output_tokens"] == 3
    assert body["output"][0]["content"][0]["text"] == first
    assert h.client.get(f"/v1/responses/{rid}").json() == body


def test_a_cancellation_asked_through_the_store_reaches_the_runner(h: Harness) -> None:
    """Another replica's cancel leaves a mark in the store that the
    replica running the response acts on."""
    h.engine.state.paused = True
    rid = _post(h, background=True).json()["id"]
    _poll(h, rid, lambda b: b["status"] == "in_progress")
    h.ingress.responses_route.store.ask_cancel(rid)
    assert _poll(h, rid, _ended)["status"] == "cancelled"
    store = h.ingress.responses_route.store
    assert not store.cancel_asked(rid)  # the marks go with the run


def test_deleting_a_running_response_stops_it_for_good(h: Harness) -> None:
    h.engine.state.paused = True
    rid = _post(h, background=True).json()["id"]
    _poll(h, rid, lambda b: b["status"] == "in_progress")
    stream = h.engine.streams[-1]
    assert h.client.delete(f"/v1/responses/{rid}").json()["deleted"] is True
    assert stream.cancelled
    time.sleep(0.1)  # nothing writes it back
    assert h.client.get(f"/v1/responses/{rid}").status_code == 404


def test_a_refusal_for_load_is_waited_out(h: Harness) -> None:
    h.engine.state.answer = "Served at last."
    h.scheduler.reject = True
    rid = _post(h, background=True).json()["id"]
    time.sleep(0.2)
    assert h.client.get(f"/v1/responses/{rid}").json()["status"] == "queued"
    h.scheduler.reject = False
    done = _poll(h, rid, _ended, timeout=15)  # after the refusal's Retry-After (2 s)
    assert done["status"] == "completed", done
    assert done["output"][0]["content"][0]["text"] == "Served at last."


def test_a_response_whose_replica_went_silent_reads_as_failed(h: Harness) -> None:
    store = h.ingress.responses_route.store
    rid = f"resp_{'a' * 32}"
    store.put(StoredResponse(response={"id": rid, "status": "in_progress", "output": [],
                                       "background": True},
                             context=[], input_items=[], background=True))
    assert h.client.get(f"/v1/responses/{rid}").json()["status"] == "in_progress"
    old = time.time() - 60
    os.utime(store.root / f"{rid}.json", (old, old))
    failed = h.client.get(f"/v1/responses/{rid}").json()
    assert failed["status"] == "failed" and "stopped" in failed["error"]["message"]
    assert h.client.get(f"/v1/responses/{rid}").json()["status"] == "failed"  # stored so


_UNENFORCEABLE = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}


@pytest.mark.parametrize("extra, param", [
    ({"store": False}, "background"),
    ({"input": "word " * 2000}, "input"),
    # What the foreground refuses before admission, refused before `queued`
    # and in the Responses API's names.
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": _UNENFORCEABLE}}},
     "text.format"),
    ({"tools": [{"type": "function", "name": "f", "parameters": _UNENFORCEABLE}]},
     "tools.0.parameters"),
])
def test_what_cannot_run_in_the_background_is_refused(h: Harness, extra: dict[str, Any],
                                                       param: str) -> None:
    before = len(h.engine.requests)
    for stream in (False, True):
        r = _post(h, background=True, stream=stream, **extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "response_format" not in r.json()["error"]["message"]
    assert len(h.engine.requests) == before


def test_a_server_that_keeps_nothing_runs_nothing_in_the_background() -> None:
    with harness(max_model_len=1024, responses={"store": False}) as h:
        r = _post(h, background=True)
        assert r.status_code == 400 and r.json()["error"]["param"] == "background"


def test_a_run_stopped_by_its_replica_reads_as_failed_not_cancelled(h: Harness) -> None:
    """A task cancelled by the replica's shutdown (no client asked) ends
    `failed`, saying why."""
    h.engine.state.paused = True
    rid = _post(h, background=True).json()["id"]
    _poll(h, rid, lambda b: b["status"] == "in_progress")
    runner = h.ingress.responses_route.background
    h.client.portal.call(_cancel_task, runner, rid)
    body = _poll(h, rid, _ended)
    assert body["status"] == "failed" and "stopped" in body["error"]["message"]


async def _cancel_task(runner: Any, rid: str) -> None:
    import asyncio

    task = runner._tasks[rid]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_a_run_outlives_the_request_that_started_it(tmp_path: Any) -> None:
    """Serve cancels the handle calls a request made when its client goes
    away (the calls made in its context); the run is made in a context of
    its own, so a client that drops a background stream leaves it running."""
    import asyncio
    import contextlib

    from ray.serve import context as serve_context

    from api.errors import APIError
    from api.responses_api import ResponsesRequest
    from api.responses_store import ResponseStore
    from deployments.responses_background import BackgroundResponses

    seen: list[bool] = []

    class Ingress:
        class door:  # noqa: N801 - stands for the ingress's attribute
            @staticmethod
            def start(offline: bool, priority: int) -> Any:
                return contextlib.nullcontext()

        @staticmethod
        async def start_chat(chat: Any) -> Any:
            seen.append(serve_context._get_serve_request_context()
                        .cancel_on_parent_request_cancel)
            raise APIError(400, "stop here")

    async def main() -> StoredResponse | None:
        serve_context._serve_request_context.set(serve_context._RequestContext(
            request_id="parent", cancel_on_parent_request_cancel=True))
        store = ResponseStore(tmp_path, 3600, 10)
        runs = BackgroundResponses(Ingress(), store)
        rid = f"resp_{'c' * 32}"
        record = StoredResponse(response={"id": rid, "status": "queued", "created_at": 0,
                                          "output": []}, context=[], input_items=[],
                                background=True)
        store.put(record)
        req = ResponsesRequest.model_validate({"input": "hi"})
        runs.start(req, req.chat(), record)
        await asyncio.gather(*runs._tasks.values())
        return store.get(rid)

    found = asyncio.run(main())
    assert seen == [False]  # the engine call is no child of the request
    assert found is not None and found.response["status"] == "failed"
