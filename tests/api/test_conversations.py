"""Conversations (`/v1/conversations`, api/conversations_route.py and
api/conversation_store.py) and Responses that continue one
(`conversation`), on the real ingress app without Ray."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from api.conversation_store import ConversationStore, NoItem
from tests.api.harness import Harness, harness
from tests.api.shapes import assert_error
from tests.api.test_responses_store import _post, _prompt

pytest.importorskip("xgrammar")


@pytest.fixture
def h(wide: Harness) -> Harness:
    return wide


def _items(h: Harness, conv_id: str, **params: Any) -> dict[str, Any]:
    r = h.client.get(f"/v1/conversations/{conv_id}/items", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def _text(item: dict[str, Any]) -> str:
    return item["content"][0]["text"]


def _message(text: str, role: str = "user") -> dict[str, Any]:
    return {"type": "message", "role": role, "content": text}


# The store --------------------------------------------------------------------


def test_the_store_keeps_items_in_order_and_no_id_reaches_outside(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "c")
    rec = store.create({"k": "v"}, [{"type": "message", "id": "msg_1", "role": "user",
                                     "content": "a"}])
    assert store.get(rec.id) == rec and rec.id.startswith("conv_")
    added = store.add_items(rec.id, [{"type": "message", "id": "msg_1", "role": "user",
                                      "content": "b"}])
    assert added is not None and added[0]["id"] != "msg_1"  # an id taken is renewed
    assert [i["content"] for i in store.get(rec.id).items] == ["a", "b"]  # type: ignore[union-attr]
    for bad in ("../x", "conv_1", "conv_" + "g" * 48, rec.id + "/"):
        assert store.get(bad) is None and store.add_items(bad, []) is None
        assert store.delete(bad) is False and store.set_metadata(bad, {}) is None
    assert not list((tmp_path / "c").glob("*.lock"))[1:]  # no lock file for unknown ids
    with pytest.raises(NoItem):
        store.delete_item(rec.id, "msg_none")
    assert store.delete(rec.id) and store.get(rec.id) is None and not store.delete(rec.id)
    assert list((tmp_path / "c").iterdir()) == []


def test_concurrent_writers_lose_no_item(tmp_path: Path) -> None:
    # Two stores over one directory: two replicas.
    stores = [ConversationStore(tmp_path), ConversationStore(tmp_path)]
    conv = stores[0].create({}, [])

    def add(k: int) -> None:
        for i in range(10):
            stores[k % 2].add_items(conv.id, [{"type": "message", "role": "user",
                                               "content": f"{k}-{i}"}])

    threads = [threading.Thread(target=add, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    found = stores[1].get(conv.id)
    assert found is not None and len(found.items) == 80
    assert len({i["id"] for i in found.items}) == 80


# The routes -------------------------------------------------------------------


def test_a_conversation_is_made_read_changed_and_deleted(h: Harness) -> None:
    r = h.client.post("/v1/conversations", json={
        "items": [_message("Hi"), _message("Hello!", "assistant")], "metadata": {"topic": "x"}})
    assert r.status_code == 200, r.text
    conv = r.json()
    assert conv["object"] == "conversation" and conv["id"].startswith("conv_")
    assert conv["metadata"] == {"topic": "x"} and conv["created_at"] <= time.time()
    cid = conv["id"]
    assert h.client.get(f"/v1/conversations/{cid}").json() == conv
    items = _items(h, cid)
    assert [_text(i) for i in items["data"]] == ["Hello!", "Hi"]  # newest first
    assert [i["content"][0]["type"] for i in items["data"]] == ["output_text", "input_text"]
    assert {i["status"] for i in items["data"]} == {"completed"}
    assert all(i["id"].startswith("msg_") for i in items["data"])
    assert _items(h, cid, order="asc")["data"] == items["data"][::-1]
    page = _items(h, cid, limit=1)
    assert page["has_more"] and _items(h, cid, after=page["last_id"])["data"] == items["data"][1:]

    added = h.client.post(f"/v1/conversations/{cid}/items", json={"items": [
        _message("More"), {"type": "function_call_output", "call_id": "c1", "output": "ok"}]})
    assert added.status_code == 200, added.text
    data = added.json()["data"]
    assert [i["type"] for i in data] == ["message", "function_call_output"]
    assert data[1]["id"].startswith("fco_")
    one = h.client.get(f"/v1/conversations/{cid}/items/{data[0]['id']}")
    assert one.json() == data[0]
    after = h.client.delete(f"/v1/conversations/{cid}/items/{data[0]['id']}")
    assert after.json() == conv
    assert len(_items(h, cid)["data"]) == 3
    assert_error(h.client.get(f"/v1/conversations/{cid}/items/{data[0]['id']}"), 404, "item_id")

    changed = h.client.post(f"/v1/conversations/{cid}", json={"metadata": {"topic": "y"}})
    assert changed.json() == {**conv, "metadata": {"topic": "y"}}
    gone = h.client.delete(f"/v1/conversations/{cid}")
    assert gone.json() == {"id": cid, "object": "conversation.deleted", "deleted": True}
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/items"), ("POST", "")):
        body = {"metadata": {}} if method == "POST" else None
        assert_error(h.client.request(method, f"/v1/conversations/{cid}{path}", json=body),
                     404, "conversation_id")


def test_conversation_requests_name_what_is_wrong(h: Harness) -> None:
    cid = h.client.post("/v1/conversations", json={}).json()["id"]
    cases = [
        ("POST", "/v1/conversations", {"items": [_message("x")] * 21}, "items"),
        ("POST", "/v1/conversations", {"metadata": {"k" * 65: "v"}}, "metadata.k" + "k" * 64),
        ("POST", "/v1/conversations", {"extra": 1}, "extra"),
        ("POST", "/v1/conversations", {"items": [{"type": "computer_call"}]}, "items.0"),
        ("POST", f"/v1/conversations/{cid}", {}, "metadata"),
        ("POST", f"/v1/conversations/{cid}/items", {"items": []}, "items"),
    ]
    for method, path, body, param in cases:
        assert_error(h.client.request(method, path, json=body), 400, param)
    assert_error(h.client.get(f"/v1/conversations/{cid}/items", params={"limit": 0}),
                 400, "limit")
    assert_error(h.client.get(f"/v1/conversations/{cid}/items", params={"after": "msg_x"}),
                 404, "after")
    assert_error(h.client.get(f"/v1/conversations/{cid}/items",
                              params={"include": "message.output_text.logprobs"}),
                 400, "include")
    assert_error(h.client.get(f"/v1/conversations/{cid}/items/msg_x", params={"x": 1}),
                 400, "x")
    assert_error(h.client.get("/v1/conversations/conv_nope"), 404, "conversation_id")
    assert_error(h.client.get("/v1/conversations/..%2F..%2Fetc"), 404)


# Responses in a conversation --------------------------------------------------


def test_responses_continue_a_conversation_and_add_their_turns(h: Harness) -> None:
    cid = h.client.post("/v1/conversations", json={"items": [
        _message("My name is Ada.")]}).json()["id"]
    h.engine.state.answer = "Hello Ada."
    first = _post(h, input="Greet me.", conversation=cid)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["conversation"] == {"id": cid} and body["previous_response_id"] is None
    assert "My name is Ada." in _prompt(h) and "Greet me." in _prompt(h)
    items = _items(h, cid, order="asc")["data"]
    assert [_text(i) for i in items[:2]] == ["My name is Ada.", "Greet me."]
    assert items[2] == body["output"][0]  # the answer, with the response's own item id

    h.engine.state.answer = "Ada."
    second = _post(h, input="What is my name?", conversation={"id": cid}, store=False)
    assert second.status_code == 200, second.text
    prompt = _prompt(h)
    assert prompt.index("My name is Ada.") < prompt.index("Hello Ada.") < prompt.index(
        "What is my name?")
    assert second.json()["usage"]["input_tokens"] > body["usage"]["input_tokens"]
    assert len(_items(h, cid)["data"]) == 5


def test_streamed_and_background_turns_are_added_before_they_end(h: Harness) -> None:
    cid = h.client.post("/v1/conversations", json={}).json()["id"]
    h.engine.state.answer = "Streamed."
    r = _post(h, input="One", conversation=cid, stream=True)
    events = [json.loads(block.split("data: ", 1)[1]) for block in r.text.split("\n\n")
              if block.strip()]
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["conversation"] == {"id": cid}
    assert _text(_items(h, cid, order="asc")["data"][0]) == "One"

    h.engine.state.answer = "Later."
    queued = _post(h, input="Two", conversation=cid, background=True).json()
    deadline = time.monotonic() + 10
    while (done := h.client.get(f"/v1/responses/{queued['id']}").json())["status"] in (
            "queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert done["status"] == "completed"
    texts = [_text(i) for i in _items(h, cid, order="asc")["data"]]
    assert texts == ["One", "Streamed.", "Two", "Later."]


def test_a_response_cannot_name_a_missing_conversation_or_two_contexts(h: Harness) -> None:
    h.engine.state.answer = "x"
    err = assert_error(_post(h, input="Hi", conversation="conv_" + "0" * 48), 404,
                       "conversation")
    assert "conversation" in err["message"]
    prev = _post(h, input="Hi").json()["id"]
    cid = h.client.post("/v1/conversations", json={}).json()["id"]
    assert_error(_post(h, input="Hi", conversation=cid, previous_response_id=prev), 400,
                 "conversation")
    assert_error(_post(h, input="Hi", conversation=5), 400, "conversation")
    assert _items(h, cid)["data"] == []


def test_the_openai_client_uses_conversations(h: Harness) -> None:
    client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=h.client)
    conv = client.conversations.create(items=[{"type": "message", "role": "user",
                                               "content": "I like tea."}],
                                       metadata={"user": "u1"})
    h.engine.state.answer = "Tea is nice."
    resp = client.responses.create(model=h.model_name, conversation=conv.id,
                                   input="What do I like?", max_output_tokens=16)
    assert resp.output_text == "Tea is nice." and "I like tea." in _prompt(h)
    listed = client.conversations.items.list(conv.id, order="asc")
    assert [i.type for i in listed.data] == ["message"] * 3
    assert listed.data[0].content[0].text == "I like tea."  # type: ignore[union-attr]
    assert listed.data[-1].id == resp.output[0].id
    assert client.conversations.retrieve(conv.id).metadata == {"user": "u1"}
    client.conversations.update(conv.id, metadata={"user": "u2"})
    assert client.conversations.retrieve(conv.id).metadata == {"user": "u2"}
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


def test_a_server_that_keeps_nothing_refuses_conversations() -> None:
    with harness(responses={"store": False}) as off:
        assert_error(off.client.post("/v1/conversations", json={}), 400)
        assert_error(off.client.post("/v1/responses", json={
            "model": off.model_name, "input": "Hi", "conversation": "conv_" + "0" * 48}),
            400, "conversation")
