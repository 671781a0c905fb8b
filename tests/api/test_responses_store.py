"""Stored responses: a conversation continued by `previous_response_id`
(through the `openai` client and by hand), read back, listed, deleted, and
the store's own bounds (`api/responses_store.py`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from api.responses_store import ResponseStore, StoredResponse
from tests.api.harness import Harness, harness

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def h(wide: Harness) -> Harness:
    return wide


def _post(h: Harness, **body: Any) -> Any:
    return h.client.post("/v1/responses", json={"model": h.model_name, "max_output_tokens": 64,
                                                **body})


def _prompt(h: Harness) -> str:
    return h.engine.state.tokenizer.decode(h.engine.requests[-1].prompt_token_ids)


def _record(i: int) -> StoredResponse:
    rid = f"resp_{i:032x}"
    return StoredResponse(response={"id": rid, "output": []}, context=[], input_items=[])


# The store ---------------------------------------------------------------------


def test_a_record_reads_back_until_deleted_and_no_id_reaches_outside(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r", 3600, 10)
    rec = _record(1)
    store.put(rec)
    assert store.get(rec.response["id"]) == rec
    for bad in ("../x", "resp_1", "resp_" + "0" * 31 + "/", "resp_" + "g" * 32):
        assert store.get(bad) is None and store.delete(bad) is False
    with pytest.raises(ValueError):
        store.put(StoredResponse(response={"id": "../evil", "output": []}, context=[],
                                 input_items=[]))
    assert store.delete(rec.response["id"]) and store.get(rec.response["id"]) is None
    assert not store.delete(rec.response["id"])
    assert [p.name for p in (tmp_path / "r").iterdir()] == []  # nothing left aside


def test_expired_and_surplus_records_are_gone_oldest_first(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path, 3600, 3)
    now = time.time()
    for i in range(6):
        store.put(_record(i))
        os.utime(tmp_path / f"resp_{i:032x}.json", (now - 100 + i, now - 100 + i))
    old = tmp_path / f"resp_{0:032x}.json"
    os.utime(old, (now - 7200, now - 7200))
    assert store.get(_record(0).response["id"]) is None and not old.exists()
    os.utime(tmp_path / f"resp_{1:032x}.json", (now - 7200, now - 7200))
    aside = tmp_path / f".resp_{9:032x}.json.abc"  # a writer that died before renaming
    aside.write_text("{")
    os.utime(aside, (now - 7200, now - 7200))
    fresh = tmp_path / f".resp_{8:032x}.json.abc"  # one being written now
    fresh.write_text("{")
    assert store.sweep() == 2  # 1 expired, then 2 (the oldest left) beyond 3
    assert not aside.exists() and fresh.exists()
    assert sorted(p.name for p in tmp_path.glob("resp_*")) == [
        f"resp_{i:032x}.json" for i in (3, 4, 5)]


# Through the API ----------------------------------------------------------------


def test_a_follow_up_continues_the_stored_conversation(h: Harness) -> None:
    h.engine.state.answer = "Hello Ada."
    first = _post(h, input="My name is Ada.", instructions="Talk like a pirate.",
                  metadata={"user": "42"})
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["store"] is True and body["metadata"] == {"user": "42"}
    assert h.client.get(f"/v1/responses/{body['id']}").json() == body

    h.engine.state.answer = "Ada."
    second = _post(h, input="What is my name?", previous_response_id=body["id"],
                   instructions="Be brief.")
    assert second.status_code == 200, second.text
    assert second.json()["previous_response_id"] == body["id"]
    prompt = _prompt(h)
    # The earlier turn and its answer, then the new input; the earlier
    # instructions are not carried over, as with OpenAI.
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n"
                             "<|im_start|>user\nMy name is Ada.<|im_end|>\n"
                             "<|im_start|>assistant\nHello Ada.<|im_end|>\n"
                             "<|im_start|>user\nWhat is my name?<|im_end|>")
    assert "pirate" not in prompt

    # Three deep: the whole chain, even with the first response deleted.
    assert h.client.delete(f"/v1/responses/{body['id']}").json() == {
        "id": body["id"], "object": "response", "deleted": True}
    third = _post(h, input="Again?", previous_response_id=second.json()["id"])
    assert third.status_code == 200, third.text
    assert "My name is Ada." in _prompt(h) and "What is my name?" in _prompt(h)
    gone = h.client.get(f"/v1/responses/{body['id']}")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"


def test_the_openai_client_chains_reads_lists_and_deletes(h: Harness) -> None:
    client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=h.client)
    h.engine.state.answer = "Checking.\n" + CALL
    first = client.responses.create(model=h.model_name, input="Weather in Paris?",
                                    tools=[WEATHER], max_output_tokens=64)  # type: ignore[list-item]
    call = first.output[-1]
    assert call.type == "function_call"
    h.engine.state.answer = "Sunny in Paris."
    second = client.responses.create(
        model=h.model_name, previous_response_id=first.id, tools=[WEATHER],  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        max_output_tokens=64)
    assert second.output_text == "Sunny in Paris."
    prompt = _prompt(h)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            in prompt and "<tool_response>\nsunny\n</tool_response>" in prompt)
    assert client.responses.retrieve(second.id).output_text == "Sunny in Paris."
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["function_call_output"] and items.data[0].id
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_a_streamed_response_is_stored_before_its_last_event(h: Harness) -> None:
    h.engine.state.answer = "Streamed."
    r = _post(h, input="Hi", stream=True)
    events = [json.loads(block.split("data: ", 1)[1]) for block in r.text.split("\n\n")
              if block.strip()]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["store"] is True
    assert h.client.get(f"/v1/responses/{final['id']}").json() == final
    follow = _post(h, input="More", previous_response_id=final["id"])
    assert follow.status_code == 200 and "Streamed." in _prompt(h)


def test_an_unstored_or_unknown_response_cannot_be_continued(h: Harness) -> None:
    h.engine.state.answer = "Not kept."
    body = _post(h, input="Hi", store=False).json()
    assert body["store"] is False
    assert h.client.get(f"/v1/responses/{body['id']}").status_code == 404
    before = len(h.engine.requests)
    for rid in (body["id"], "resp_nope", "../../etc/passwd"):
        r = _post(h, input="More", previous_response_id=rid)
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert len(h.engine.requests) == before  # nothing reached the engine
    assert h.client.delete("/v1/responses/resp_nope").status_code == 404
    assert h.client.get(f"/v1/responses/{body['id']}?stream=true").status_code == 404
    # Only a streamed background response streams again.
    kept = _post(h, input="Hi").json()["id"]
    bad = h.client.get(f"/v1/responses/{kept}?stream=true")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream"


def test_input_items_page_in_either_order(h: Harness) -> None:
    h.engine.state.answer = "ok"
    body = _post(h, input=[{"role": "user", "content": c} for c in "abc"]).json()
    url = f"/v1/responses/{body['id']}/input_items"
    page = h.client.get(url, params={"limit": 2, "order": "asc"}).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["a", "b"] and page["has_more"] is True
    rest = h.client.get(url, params={"order": "asc", "after": page["last_id"]}).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["c"] and rest["has_more"] is False
    newest = h.client.get(url).json()
    assert [i["content"][0]["text"] for i in newest["data"]] == ["c", "b", "a"]
    assert all(i["id"].startswith("msg_") and i["type"] == "message" for i in newest["data"])
    assert h.client.get(url, params={"limit": 0}).status_code == 400
    assert h.client.get(url, params={"after": "msg_nope"}).status_code == 404


def test_an_answer_sent_back_whole_is_accepted(h: Harness) -> None:
    """`input = [*earlier_input, *response.output]`: output items carry
    fields (ids, statuses, logprobs) an input item does not need."""
    h.engine.state.answer = "Hello."
    body = _post(h, input="Hi", store=False).json()
    r = _post(h, input=[{"role": "user", "content": "Hi"}, *body["output"],
                        {"role": "user", "content": "And?"}], store=False)
    assert r.status_code == 200, r.text
    assert "<|im_start|>assistant\nHello.<|im_end|>" in _prompt(h)


def test_a_server_that_keeps_nothing_says_so() -> None:
    with harness(max_model_len=1024, responses={"store": False}) as h:
        h.engine.state.answer = "ok"
        r = _post(h, input="Hi")
        assert r.status_code == 200 and r.json()["store"] is False
        for extra, param in (({"store": True}, "store"),
                             ({"previous_response_id": r.json()["id"]}, "previous_response_id")):
            bad = _post(h, input="Hi", **extra)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param
        assert h.client.get(f"/v1/responses/{r.json()['id']}").status_code == 404


# truncation: "auto" ---------------------------------------------------------------


def test_fit_drops_the_fewest_items_from_the_beginning() -> None:
    from api.responses_api import FunctionCallOutputItem, MessageItem
    from api.responses_truncation import fit

    def msg(n: int) -> MessageItem:
        return MessageItem(role="user", content="x" * n)

    out = FunctionCallOutputItem(type="function_call_output", call_id="c", output="o" * 5)
    probes: list[int] = []

    def tokens(kept: list[Any]) -> int:
        probes.append(len(kept))
        return sum(len(i.content) if isinstance(i, MessageItem) else len(i.output)
                   for i in kept)

    items = [msg(50), msg(40), msg(30), msg(20), msg(10)]
    assert fit(items, tokens, room=10, limit=200) == items  # fits whole
    assert fit(items, tokens, room=10, limit=65) == items[3:]  # 30 + 10 room; 60 + 10 not
    assert fit(items, tokens, room=10, limit=15) == items[-1:]  # the last stays
    probes.clear()
    long = [msg(10) for _ in range(64)]
    assert fit(long, tokens, room=0, limit=105) == long[-10:]
    assert len(probes) <= 8  # a binary search, not one probe per item
    # A result whose call was dropped goes with it.
    assert fit([msg(50), out, msg(10)], tokens, room=0, limit=20) == [items[-1]]


def test_auto_truncation_lets_a_long_chain_go_on(h: Harness) -> None:
    h.engine.state.answer = "Noted."
    first = _post(h, input="alpha " + "word " * 600).json()
    long_turn = "omega " + "word " * 500
    refused = _post(h, input=long_turn, previous_response_id=first["id"])
    assert refused.status_code == 400, refused.text
    r = _post(h, input=long_turn, previous_response_id=first["id"], truncation="auto",
              instructions="Be brief.")
    assert r.status_code == 200, r.text
    assert r.json()["truncation"] == "auto"
    prompt = _prompt(h)
    assert "omega" in prompt and "alpha" not in prompt and prompt.startswith(
        "<|im_start|>system\nBe brief.")
    assert r.json()["usage"]["input_tokens"] + 64 <= 1024
    # The stored record keeps the whole conversation.
    items = h.client.get(f"/v1/responses/{r.json()['id']}/input_items").json()["data"]
    assert [i["content"][0]["text"][:5] for i in items] == ["omega"]


def test_a_store_that_fails_loses_no_answer(h: Harness, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """A write that fails (a full disk) still answers, with `store: false`."""
    store = h.ingress.responses_route.store

    def full(record: StoredResponse) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "put", full)
    h.engine.state.answer = "Still answered."
    body = _post(h, input="Hi").json()
    assert body["store"] is False and body["output"][0]["content"][0]["text"] == "Still answered."
    r = _post(h, input="Hi", stream=True)
    final = json.loads(r.text.strip().split("\n\n")[-1].split("data: ", 1)[1])
    assert final["type"] == "response.completed" and final["response"]["store"] is False


def test_an_unusable_storage_dir_fails_at_start_naming_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="responses.storage_dir"):
        ResponseStore(tmp_path / "file" / "responses", 3600, 10)
