"""Property-based corpus for the Responses and Messages APIs (and
`count_tokens`): requests built around a valid one, with fields (their
items, content blocks, tools) set to plausible and wild values.  Whatever
is sent, the answer is below 500; a refusal has the route's error shape
(OpenAI's on `/v1/responses`, Anthropic's on `/v1/messages`); an answer has
the route's object shape; every admitted job is released.  And the routes
that read, list, change and delete what the server keeps (conversations,
stored responses and chat completions, files, batches), by real and
made-up ids, with any query and body: below 500, in the route's error shape.

Derandomized, as `test_corpus.py`; PREEMPT_SERVE_FUZZ_EXAMPLES runs more.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx2
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from api.messages_api import MessagesRequest
from api.responses_api import ResponsesRequest
from tests.api.harness import Harness
from tests.api.shapes import assert_error
from tests.api.strategies import TEXT, WILD, encode
from tests.api.test_corpus import check_answer, check_released, fuzz

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"

_SCHEMA = st.one_of(st.just({"type": "object", "properties": {"city": {"type": "string"}}}),
                    st.just({"type": "object"}), st.just({"type": "nope"}), WILD)
# Words as clients write them (and the edges the APIs name: empty, a
# trailing space), beside TEXT's wild characters.
_WORDS = st.sampled_from(["Hi", "Paris?", "Sunny ", "", " "])
_ARGUMENTS = st.one_of(st.just('{"city": "Paris"}'), st.just("{}"), st.just("[1]"), TEXT)

_TEXT_BLOCK = st.fixed_dictionaries({"type": st.just("text"), "text": _WORDS | TEXT})
_BLOCK = st.one_of(
    _TEXT_BLOCK,
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.sampled_from(["t1", ""]),
                           "name": st.sampled_from(["get_weather", ""]),
                           "input": st.one_of(st.just({"city": "Paris"}), WILD)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.just("t1"),
                           "content": st.one_of(TEXT, st.lists(_TEXT_BLOCK, max_size=2))},
                          optional={"is_error": st.booleans()}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "redacted_thinking"])},
                          optional={"thinking": TEXT, "signature": TEXT, "data": TEXT}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", ""])}),
    WILD)
_MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "user", "assistant", "assistant", "system"]),
    "content": st.one_of(_WORDS, _WORDS, TEXT, st.lists(_BLOCK, max_size=3))})
_MESSAGES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.lists(_MESSAGE, min_size=1, max_size=4),
    "system": st.one_of(TEXT, st.lists(_TEXT_BLOCK, max_size=2)),
    "max_tokens": st.integers(0, 8),
    "stop_sequences": st.lists(TEXT, max_size=5),
    "temperature": st.floats(0, 1.5),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-1, 60),
    "stream": st.booleans(),
    "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["get_weather", ""]),
                                             "input_schema": _SCHEMA}), max_size=2),
    "tool_choice": st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none", "some"])},
        optional={"name": st.sampled_from(["get_weather", "nope"]),
                  "disable_parallel_tool_use": st.booleans()}),
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "x"])},
                                      optional={"budget_tokens": st.integers(0, 2048)}),
    "output_config": st.fixed_dictionaries({}, optional={
        "format": st.fixed_dictionaries({"type": st.just("json_schema"), "schema": _SCHEMA}),
        "effort": st.sampled_from(["low", "high"])}),
}

_PART = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "x"]),
                               "text": TEXT})
_ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer",
                                                    "tool"]),
                           "content": st.one_of(_WORDS, TEXT, st.lists(_PART, max_size=2))},
                          optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"),
                           "call_id": st.sampled_from(["c1", ""]),
                           "name": st.just("get_weather"), "arguments": _ARGUMENTS}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("c1"),
                           "output": st.one_of(TEXT, WILD)}),
    st.fixed_dictionaries({"type": st.just("reasoning")}, optional={"summary": WILD}),
    WILD)
_RESPONSES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "input": st.one_of(TEXT, st.lists(_ITEM, max_size=4)),
    "instructions": TEXT,
    "max_output_tokens": st.integers(0, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "stream": st.booleans(),
    "store": st.booleans(),
    "background": st.booleans(),
    "previous_response_id": st.sampled_from(["resp_nope", ""]),
    "truncation": st.sampled_from(["auto", "disabled", "x"]),
    "tools": st.lists(st.fixed_dictionaries({
        "type": st.sampled_from(["function", "web_search"]),
        "name": st.sampled_from(["get_weather", ""]), "parameters": _SCHEMA}), max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "x"]),
                             st.fixed_dictionaries({"type": st.just("function"),
                                                    "name": st.sampled_from(["get_weather",
                                                                             "nope"])})),
    "text": st.fixed_dictionaries({"format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
        st.fixed_dictionaries({"type": st.just("json_schema"), "name": st.just("out"),
                               "schema": _SCHEMA}))}),
    "include": st.lists(st.sampled_from(["message.output_text.logprobs", "x"]), max_size=2),
    "top_logprobs": st.integers(0, 21),
    "metadata": st.dictionaries(TEXT, TEXT, max_size=2),
}


def _fields(plausible: dict[str, st.SearchStrategy[Any]],
            every: list[str]) -> st.SearchStrategy[str]:
    # Mostly the fields served, so that answers are fuzzed too; any now and then.
    known = st.sampled_from(sorted(plausible))
    return st.one_of(known, known, known, st.sampled_from(every))


@st.composite
def route_request(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid Responses, Messages or count_tokens request with a few fields
    set to drawn values."""
    path = draw(st.sampled_from([RESPONSES, MESSAGES, COUNT]))
    if path == RESPONSES:
        body: dict[str, Any] = {"model": "smollm2", "input": "Hi", "max_output_tokens": 3}
        plausible, every = _RESPONSES_FIELDS, sorted(ResponsesRequest.model_fields)
    else:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}],
                **({"max_tokens": 3} if path == MESSAGES else {})}
        plausible, every = _MESSAGES_FIELDS, sorted(MessagesRequest.model_fields)
    for name in draw(st.lists(_fields(plausible, every), max_size=4, unique=True)):
        strategy = plausible.get(name)
        body[name] = draw(st.one_of(strategy, strategy, strategy, WILD)
                          if strategy is not None else st.one_of(st.none(), WILD))
    if draw(st.integers(0, 4)) == 0:
        body.pop(draw(st.sampled_from(sorted(body))))
    return path, body


def _check_shape(r: httpx2.Response, path: str, method: str = "POST") -> None:
    """Below 500, a non-2xx in the route's error shape: Anthropic's under
    `/v1/messages`, OpenAI's elsewhere (`check_answer`)."""
    if not path.startswith("/v1/messages"):
        check_answer(r, method)
        return
    event(f"status {r.status_code}")
    if r.status_code != 200:
        _anthropic_error(r)


def _anthropic_error(r: httpx2.Response) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    body = r.json()
    if r.status_code == 401:  # the auth layer's, OpenAI's shape (README)
        assert_error(r)
        return
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body


def _answered(r: httpx2.Response, path: str, body: dict[str, Any]) -> None:
    if body.get("stream") is True and path != COUNT:
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        # An error event is fine; a server error in one is not.
        assert "internal error" not in r.text and "server_error" not in r.text, r.text[:500]
        return
    answer = r.json()
    if path == RESPONSES:
        assert answer["object"] == "response" and answer["status"] in (
            "completed", "incomplete", "queued", "in_progress"), answer
    elif path == MESSAGES:
        assert answer["type"] == "message" and answer["role"] == "assistant", answer
        assert answer["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence",
                                         "tool_use"), answer
    else:
        assert set(answer) == {"input_tokens"} and answer["input_tokens"] > 0, answer


@given(request=route_request(), ascii_only=st.booleans())
@fuzz(share=3.0)
def test_responses_and_messages_requests(served: Harness, request: tuple[str, dict[str, Any]],
                                         ascii_only: bool) -> None:
    path, body = request
    r = served.client.post(path, content=encode(body, ascii_only),
                           headers={"content-type": "application/json"})
    _check_shape(r, path)
    if r.status_code == 200:
        _answered(r, path, body)
    check_released(served)


# The routes that read, list, change and delete what the server keeps, by
# ids real (made below) and not, with any query and body.
_STORE_ROUTES = [
    ("POST", "/v1/conversations"), ("GET", "/v1/conversations/{}"),
    ("POST", "/v1/conversations/{}"), ("DELETE", "/v1/conversations/{}"),
    ("GET", "/v1/conversations/{}/items"), ("POST", "/v1/conversations/{}/items"),
    ("GET", "/v1/conversations/{}/items/{}"), ("DELETE", "/v1/conversations/{}/items/{}"),
    ("GET", "/v1/responses/{}"), ("GET", "/v1/responses/{}/input_items"),
    ("POST", "/v1/responses/{}/cancel"), ("DELETE", "/v1/responses/{}"),
    ("GET", "/v1/chat/completions"), ("GET", "/v1/chat/completions/{}"),
    ("POST", "/v1/chat/completions/{}"), ("DELETE", "/v1/chat/completions/{}"),
    ("GET", "/v1/chat/completions/{}/messages"), ("GET", "/v1/models/{}"),
    ("GET", "/v1/files"), ("GET", "/v1/batches"), ("GET", "/v1/messages/batches")]
_QUERY = st.dictionaries(
    st.sampled_from(["limit", "after", "before", "order", "include", "stream", "model",
                     "metadata[k]", "starting_after"]),
    st.sampled_from(["-1", "0", "1e9", "asc", "desc", "true", "x", "9" * 24]) | TEXT, max_size=3)
_FAKE_IDS = ["conv_x", "resp_x", "chatcmpl-x", "msg_x", "..", "%00", "x" * 300]


@pytest.fixture(scope="module")
def kept(served: Harness) -> list[str]:
    """A conversation, a response and a stored chat completion."""
    c = served.client
    model = served.model_name
    return [c.post("/v1/conversations", json={"items": [{"role": "user", "content": "hi"}]}
                   ).json()["id"],
            c.post(RESPONSES, json={"model": model, "input": "hi", "max_output_tokens": 3}
                   ).json()["id"],
            c.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3, "store": True}).json()["id"]]


@given(route=st.sampled_from(_STORE_ROUTES),
       ids=st.lists(st.integers(0, 2 + len(_FAKE_IDS)), min_size=2, max_size=2),
       query=_QUERY, body=WILD, ascii_only=st.booleans())
@fuzz(share=1.0)
def test_store_routes(served: Harness, kept: list[str], route: tuple[str, str],
                      ids: list[int], query: dict[str, str], body: Any, ascii_only: bool) -> None:
    method, path = route
    # Real ids as often as made-up ones: the routes behind the lookup run too.
    names = [(kept + _FAKE_IDS)[i] for i in ids]
    path = path.format(*[quote(n, safe="") for n in names])
    try:
        url = httpx2.URL(path, params=query)
    except (httpx2.InvalidURL, UnicodeEncodeError):
        return  # not a URL a client could send
    content = encode(body, ascii_only) if method == "POST" else None
    r = served.client.request(method, url, content=content,
                              headers={"content-type": "application/json"})
    _check_shape(r, path, method)
