"""Streamed background Responses (`background: true, stream: true`,
deployments/responses_background.py): the events as they happen, the same
events again for a client that reconnects (`GET /v1/responses/{id}?stream=
true&starting_after=N`), from any replica, during the run or after it, a
cancellation and a lost replica ending the stream."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import pytest
from openai import OpenAI

from api.responses_store import StoredResponse
from tests.api.harness import Harness
from tests.api.test_responses_background import _ended, _poll, _post

pytest.importorskip("xgrammar")


@pytest.fixture
def h(wide: Harness) -> Any:
    yield wide
    wide.engine.state.paused, wide.engine.state.free_wakeups = False, 0


def events_of(text: str) -> list[dict[str, Any]]:
    return [json.loads(block.split("data: ", 1)[1]) for block in text.split("\n\n")
            if block.strip()]


def _stream(h: Harness, rid: str, **params: Any) -> list[dict[str, Any]]:
    r = h.client.get(f"/v1/responses/{rid}", params={"stream": "true", **params})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return events_of(r.text)


def _in_thread(call: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(call()))
    t.start()
    return t, out


def test_events_stream_at_once_and_again_from_any_point(h: Harness) -> None:
    h.engine.state.answer = "The quick brown fox."
    r = _post(h, background=True, stream=True)
    assert r.status_code == 200, r.text
    events = events_of(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "queued" and events[0]["response"]["background"]
    final = events[-1]["response"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == final["output"][0]["content"][0]["text"] == "The quick brown fox."
    rid = final["id"]
    assert h.client.get(f"/v1/responses/{rid}").json() == final
    assert _stream(h, rid) == events
    assert _stream(h, rid, starting_after=4) == events[5:]
    assert _stream(h, rid, starting_after=len(events) - 1) == []


def test_a_client_reconnecting_mid_run_gets_the_rest_as_it_comes(h: Harness) -> None:
    h.engine.state.answer = "One two three four five six seven eight."
    h.engine.state.paused, h.engine.state.free_wakeups = True, 3
    first, out, rid = _started(h)
    _poll(h, rid, lambda b: b["status"] == "in_progress")
    time.sleep(0.2)  # the three free tokens are logged
    again, rest = _in_thread(lambda: _stream(h, rid, starting_after=3))
    time.sleep(0.2)
    assert again.is_alive()  # following: the run is held
    h.engine.state.paused = False
    first.join(10)
    again.join(10)
    events = events_of(out[0].text)
    assert events[-1]["type"] == "response.completed"
    assert rest[0] == events[4:]


def test_a_cancelled_stream_ends_with_what_it_had(h: Harness) -> None:
    h.engine.state.answer = "One two three four five six seven eight."
    h.engine.state.paused, h.engine.state.free_wakeups = True, 3
    first, out, rid = _started(h)
    _poll(h, rid, lambda b: b["status"] == "in_progress")
    time.sleep(0.2)
    body = h.client.post(f"/v1/responses/{rid}/cancel").json()
    first.join(10)
    events = events_of(out[0].text)
    last = events[-1]
    assert last["type"] == "response.incomplete" and last["response"] == body
    assert body["status"] == "cancelled" and body["usage"]["output_tokens"] == 3
    assert [e["type"] for e in events[-4:-1]] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert streamed == body["output"][0]["content"][0]["text"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_stream_whose_replica_went_silent_ends_failed(h: Harness) -> None:
    store = h.ingress.responses_route.store
    rid = f"resp_{'b' * 32}"
    response = {"id": rid, "status": "in_progress", "output": [], "background": True}
    store.put(StoredResponse(response=response, context=[], input_items=[], background=True))
    opening = [{"type": t, "sequence_number": i, "response": response}
               for i, t in enumerate(("response.created", "response.queued",
                                      "response.in_progress"))]
    store.log_events(rid, opening)
    old = time.time() - 60
    os.utime(store.root / f"{rid}.json", (old, old))
    events = _stream(h, rid)
    assert events[:3] == opening
    assert events[3]["type"] == "response.failed" and events[3]["sequence_number"] == 3
    assert "stopped" in events[3]["response"]["error"]["message"]


def test_stream_queries_name_what_is_wrong(h: Harness) -> None:
    h.engine.state.answer = "ok"
    rid = events_of(_post(h, background=True, stream=True).text)[-1]["response"]["id"]
    for params, param in (({"starting_after": 2}, "starting_after"),
                          ({"stream": "true", "starting_after": -2}, "starting_after"),
                          ({"stream": "maybe"}, "stream"), ({"x": "1"}, "x")):
        r = h.client.get(f"/v1/responses/{rid}", params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (params, r.text)
    plain = _post(h, background=True).json()["id"]
    _poll(h, plain, _ended)
    r = h.client.get(f"/v1/responses/{plain}", params={"stream": "true"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    h.client.delete(f"/v1/responses/{rid}")
    assert not h.ingress.responses_route.store.has_events(rid)


def test_the_openai_client_streams_and_resumes(h: Harness) -> None:
    client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=h.client)
    h.engine.state.answer = "Streamed in the background."
    seen = list(client.responses.create(model=h.model_name, input="Hi", background=True,
                                        stream=True, max_output_tokens=32))
    assert seen[0].type == "response.created" and seen[-1].type == "response.completed"
    rid = seen[0].response.id
    again = list(client.responses.retrieve(rid, stream=True, starting_after=2))
    assert [e.sequence_number for e in again] == [e.sequence_number for e in seen[3:]]
    assert again[-1].response.output_text == "Streamed in the background."


def _started(h: Harness) -> tuple[threading.Thread, list[Any], str]:
    """A streamed background response posted from a thread (its body is
    read to its end there), and its id once its events are logged."""
    logs = h.ingress.responses_route.store.root
    before = set(logs.glob("resp_*.events"))
    first, out = _in_thread(lambda: _post(h, background=True, stream=True))
    deadline = time.monotonic() + 10
    while not (new := set(logs.glob("resp_*.events")) - before):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return first, out, new.pop().stem


def test_a_follower_on_another_replica_reads_the_run_as_it_goes(h: Harness) -> None:
    """Another replica has no wake-up from the run: it looks at the store's
    log every `FOLLOW_S` and still gets every event, in order, to the last."""
    import asyncio

    from deployments.responses_background import BackgroundResponses

    h.engine.state.answer = "One two three four five six seven eight."
    h.engine.state.paused, h.engine.state.free_wakeups = True, 2
    first, out, rid = _started(h)
    _poll(h, rid, lambda b: b["status"] == "in_progress")
    other = BackgroundResponses(h.ingress, h.ingress.responses_route.store)

    async def follow() -> list[dict[str, Any]]:
        return [e async for e in other.follow(rid, -1)]

    followed, got = _in_thread(lambda: asyncio.run(follow()))
    time.sleep(0.3)
    assert followed.is_alive()  # waiting on the held run
    h.engine.state.paused = False
    first.join(10)
    followed.join(10)
    assert got[0] == events_of(out[0].text)
    assert got[0][-1]["type"] == "response.completed"
