"""Stored chat completions (`store: true`, api/chat_store.py,
api/chat_store_route.py): the store alone, then the routes on the real
ingress app without Ray, through the `openai` client as users call them."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from api.chat_store import ChatCompletionStore, NoCursor, StoredChatCompletion
from tests.api.harness import Harness, harness
from tests.api.shapes import assert_error


def _record(i: int, model: str = "m", **metadata: str) -> StoredChatCompletion:
    return StoredChatCompletion(
        completion={"id": f"chatcmpl-{i:032x}", "model": model, "metadata": metadata},
        messages=[{"id": f"chatcmpl-{i:032x}-0", "role": "user", "content": str(i)}])


def _ids(records: list[StoredChatCompletion]) -> list[int]:
    return [int(r.id.split("-")[1], 16) for r in records]


def _everything(r: StoredChatCompletion) -> bool:
    return True


# The store ---------------------------------------------------------------------


def test_the_store_lists_in_stored_order_and_pages_through(tmp_path: Path) -> None:
    store = ChatCompletionStore(tmp_path, retention_s=3600, max_stored=100)
    for i in (5, 3, 9, 1):  # stored order, not id order
        store.put(_record(i))
    assert _ids(store.page("asc", None, 10, _everything)[0]) == [5, 3, 9, 1]
    page, more = store.page("desc", None, 2, _everything)
    assert _ids(page) == [1, 9] and more
    page, more = store.page("desc", page[-1].id, 2, _everything)
    assert _ids(page) == [3, 5] and not more
    # A filter reads on until the page is full, and knows whether more match.
    odd_over_2 = store.page("asc", None, 1, lambda r: _ids([r])[0] > 2)
    assert _ids(odd_over_2[0]) == [5] and odd_over_2[1]
    with pytest.raises(NoCursor):
        store.page("asc", "chatcmpl-" + "f" * 32, 10, _everything)


def test_new_metadata_keeps_the_place_in_the_listing_and_a_delete_is_final(
        tmp_path: Path) -> None:
    store = ChatCompletionStore(tmp_path, retention_s=3600, max_stored=100)
    for i in range(3):
        store.put(_record(i))
    changed = store.set_metadata(_record(0).id, {"k": "v"})
    assert changed is not None and changed.completion["metadata"] == {"k": "v"}
    assert store.get(_record(0).id).completion["metadata"] == {"k": "v"}  # type: ignore[union-attr]
    assert _ids(store.page("asc", None, 10, _everything)[0]) == [0, 1, 2]
    assert store.delete(_record(1).id) and not store.delete(_record(1).id)
    assert store.set_metadata(_record(1).id, {}) is None  # not brought back
    assert store.get(_record(1).id) is None and not (tmp_path / f"{_record(1).id}.json").exists()
    assert [p.stem for p in tmp_path.glob("*.lock")] == [_record(0).id]  # 1's went with it
    for bad in ("../x", "chatcmpl-1", "chatcmpl-" + "g" * 32, _record(0).id + "/"):
        assert store.get(bad) is None and not store.delete(bad)
        assert store.set_metadata(bad, {}) is None


def test_expired_records_read_as_missing_and_the_oldest_go_past_the_bound(
        tmp_path: Path) -> None:
    store = ChatCompletionStore(tmp_path, retention_s=3600, max_stored=3)
    for i in range(5):
        store.put(_record(i))
    old = time.time() - 7200
    os.utime(tmp_path / f"{_record(4).id}.json", (old, old))
    assert store.get(_record(4).id) is None  # expired, and gone
    assert _ids(store.page("asc", None, 10, _everything)[0]) == [0, 1, 2, 3]
    assert store.sweep() == 1  # four left, bound three: the oldest goes
    assert _ids(store.page("asc", None, 10, _everything)[0]) == [1, 2, 3]


# The routes --------------------------------------------------------------------


@pytest.fixture(scope="module")
def h() -> Iterator[Harness]:
    with harness(max_model_len=1024) as h:
        yield h


@pytest.fixture
def client(h: Harness) -> Iterator[OpenAI]:
    yield OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=h.client)
    for c in h.ingress.chat_store.store.page("asc", None, 100, _everything)[0]:
        h.ingress.chat_store.store.delete(c.id)


def test_a_stored_completion_reads_back_with_its_messages_and_metadata(
        client: OpenAI, h: Harness) -> None:
    messages: Any = [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                  {"type": "text", "text": "there"}]}]
    done = client.chat.completions.create(model=h.model_name, messages=messages, max_tokens=8,
                                          temperature=0.5, seed=7, store=True,
                                          metadata={"topic": "greeting"})
    got = client.chat.completions.retrieve(done.id)
    assert got.choices[0].message.content == done.choices[0].message.content
    assert got.usage == done.usage and got.model == h.model_name
    extra = got.model_extra or {}
    assert got.metadata == {"topic": "greeting"}
    assert extra["seed"] == 7 and extra["temperature"] == 0.5
    listed = client.chat.completions.messages.list(done.id)
    assert [(m.id, m.role, m.content) for m in listed.data] == [
        (f"{done.id}-0", "system", "Be brief."), (f"{done.id}-1", "user", "Hi there")]
    parts = (listed.data[1].model_extra or {}).get("content_parts") or \
        [p.model_dump() for p in listed.data[1].content_parts or []]
    assert [p["text"] for p in parts] == ["Hi ", "there"]
    newest = client.chat.completions.messages.list(done.id, order="desc", limit=1)
    assert [m.id for m in newest.data] == [f"{done.id}-1"] and newest.has_more
    updated = client.chat.completions.update(done.id, metadata={"topic": "hello"})
    assert updated.metadata == {"topic": "hello"}
    deleted = client.chat.completions.delete(done.id)
    assert deleted.deleted and deleted.id == done.id
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(done.id)


def test_only_stored_completions_are_listed_filtered_by_model_and_metadata(
        client: OpenAI, h: Harness) -> None:
    def ask(store: bool, **metadata: str) -> str:
        extra = {"store": True, "metadata": metadata} if store else {}
        return client.chat.completions.create(
            model=h.model_name, max_tokens=4, messages=[{"role": "user", "content": "x"}],
            **extra).id  # type: ignore[call-overload]

    a = ask(True, team="a", run="1")
    ask(False)
    b = ask(True, team="b")
    c = ask(True, team="a", run="2")
    assert [x.id for x in client.chat.completions.list()] == [a, b, c]  # oldest first
    assert [x.id for x in client.chat.completions.list(metadata={"team": "a"})] == [a, c]
    assert [x.id for x in client.chat.completions.list(
        metadata={"team": "a", "run": "2"})] == [c]
    assert [x.id for x in client.chat.completions.list(model="other")] == []
    first = client.chat.completions.list(order="desc", limit=2)
    assert [x.id for x in first.data] == [c, b] and first.has_more
    # The client's auto-pagination follows `after` to the end.
    assert [x.id for x in client.chat.completions.list(limit=1)] == [a, b, c]


def _stream(h: Harness, client: OpenAI, **extra: Any) -> tuple[list[dict[str, Any]], Any]:
    """A streamed `store: true` chat's chunks, and the stored completion as
    read back on the arrival of `[DONE]` (the server stores it first)."""
    chunks: list[dict[str, Any]] = []
    with h.client.stream("POST", "/v1/chat/completions", json={
            "model": h.model_name, "max_tokens": 64, "stream": True, "store": True,
            "messages": [{"role": "user", "content": "Paris?"}], **extra}) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return chunks, client.chat.completions.retrieve(chunks[0]["id"])
            if line.startswith("data: "):
                chunks.append(json.loads(line[len("data: "):]))
    raise AssertionError("the stream did not end with [DONE]")


def test_a_streamed_completion_is_stored_whole_before_its_end(client: OpenAI,
                                                              h: Harness) -> None:
    h.engine.state.answer = "Stored as streamed."
    try:
        _, got = _stream(h, client)
    finally:
        h.engine.state.answer = None
    assert got.choices[0].message.content == "Stored as streamed."
    assert got.choices[0].finish_reason == "stop" and got.usage is not None


def test_streamed_tool_calls_are_stored_as_they_were_sent(client: OpenAI, h: Harness) -> None:
    pytest.importorskip("xgrammar")
    weather = {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                              "properties": {"city": {"type": "string"}}}}}
    h.engine.state.answer = ('Checking.\n<tool_call>\n{"name": "get_weather", '
                             '"arguments": {"city": "Paris"}}\n</tool_call>')
    try:
        chunks, got = _stream(h, client, tools=[weather])
    finally:
        h.engine.state.answer = None
    sent = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    message = got.choices[0].message
    assert message.content == "Checking." and got.choices[0].finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []] \
        == [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in sent]
    assert (got.model_extra or {})["tools"][0]["function"]["name"] == "get_weather"


def test_refusals_name_the_field(h: Harness) -> None:
    chat = {"model": h.model_name, "max_tokens": 4, "messages": [{"role": "user",
                                                                   "content": "x"}]}
    r = h.client.post("/v1/chat/completions", json={**chat, "metadata": {"k": "v"}})
    assert_error(r, 400, param="metadata")
    r = h.client.post("/v1/chat/completions", json={**chat, "store": True,
                                                    "metadata": {"k": 1}})
    assert_error(r, 400, param="metadata.k")
    r = h.client.post("/v1/completions", json={"model": h.model_name, "prompt": "x",
                                               "store": True})
    assert_error(r, 400, param="store")
    missing = "chatcmpl-" + "0" * 32
    for method in ("GET", "DELETE"):
        assert_error(h.client.request(method, f"/v1/chat/completions/{missing}"), 404,
                     param="completion_id")
    assert_error(h.client.get(f"/v1/chat/completions/{missing}/messages"), 404,
                 param="completion_id")
    assert_error(h.client.post(f"/v1/chat/completions/{missing}", json={"metadata": {}}),
                 404, param="completion_id")
    assert_error(h.client.get("/v1/chat/completions", params={"after": missing}), 404,
                 param="after")
    assert_error(h.client.get("/v1/chat/completions", params={"metadata": "k"}), 400,
                 param="metadata")
    # A nested or nameless key (schemathesis sent `metadata[][]=`).
    for name in ("metadata[][]", "metadata[]", "metadata[a][b]"):
        assert_error(h.client.get("/v1/chat/completions", params={name: ""}), 400,
                     param="metadata")
    assert_error(h.client.get("/v1/chat/completions", params={"limit": 0}), 400,
                 param="limit")
    assert_error(h.client.get("/v1/chat/completions", params={"colour": "red"}), 400,
                 param="colour")
    r = h.client.put("/v1/chat/completions")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD", "POST"}


def test_a_server_that_keeps_nothing_refuses_store() -> None:
    with harness(responses={"store": False}) as h:
        r = h.client.post("/v1/chat/completions", json={
            "model": h.model_name, "max_tokens": 4, "store": True,
            "messages": [{"role": "user", "content": "x"}]})
        assert_error(r, 400, param="store")
        assert h.engine.requests == []  # refused before it ran
        assert_error(h.client.get("/v1/chat/completions"), 400)


def test_a_batch_line_with_store_is_kept(client: OpenAI, h: Harness) -> None:
    out = asyncio.run(h.ingress.batch_request("/v1/chat/completions", {
        "model": h.model_name, "max_tokens": 4, "store": True, "metadata": {"via": "batch"},
        "messages": [{"role": "user", "content": "x"}]}))
    assert out["status_code"] == 200, out
    listed = client.chat.completions.list(metadata={"via": "batch"})
    assert [c.id for c in listed] == [out["body"]["id"]]
