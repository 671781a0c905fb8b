"""`POST /v1/responses` as the `openai` client meets it: a Response object
and its streamed events, read by the client's own types and its stream
accumulator; `input`, `instructions`, tools and `text.format` reach the
engine as the chat completion they amount to; and a 400 names the
Responses field for what cannot be served."""

from __future__ import annotations

import json
import typing
from typing import Any

import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, ValidationError

from tests.api.harness import Harness

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
_EVENTS = {typing.get_args(c.model_fields["type"].annotation)[0]: c
           for c in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


@pytest.fixture
def h(wide: Harness) -> Harness:
    return wide


def _client(h: Harness) -> OpenAI:
    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=h.client)


def _valid(model: type[BaseModel], obj: dict[str, Any]) -> None:
    """`obj` is what the client's type describes (newer clients also ask for
    `cache_write_tokens`, a count of paid cache writes this server has no
    equivalent of)."""
    try:
        model.model_validate(obj)
    except ValidationError as e:
        errors = [x for x in e.errors() if x["loc"][-1] != "cache_write_tokens"]
        assert not errors, errors


def _post(h: Harness, **body: Any) -> Any:
    return h.client.post("/v1/responses", json={"model": h.model_name, "input": "Paris?",
                                                "max_output_tokens": 64, **body})


def _events(r: Any) -> list[dict[str, Any]]:
    out = []
    for block in r.text.split("\n\n"):
        if block.strip():
            head, data = block.split("\n", 1)
            event = json.loads(data.removeprefix("data: "))
            assert head == f"event: {event['type']}"
            _valid(_EVENTS[event["type"]], event)
            out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_a_text_answer_is_a_response(h: Harness) -> None:
    h.engine.state.answer = "Paris is sunny."
    # OpenAI's in-memory prompt cache is what this server has.
    r = _post(h, instructions="Be brief.", max_tool_calls=3, prompt_cache_retention="in_memory",
              prompt_cache_options={"mode": "implicit"},
              background_options={"completion_window": "soonest"})
    assert r.status_code == 200, r.text
    body = r.json()
    _valid(Response, body)
    assert body["max_tool_calls"] == 3 and body["conversation"] is None
    assert body["status"] == "completed" and body["model"] == h.model_name
    assert body["id"].startswith("resp_") and body["store"] is True
    (item,) = body["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == "Paris is sunny."
    request = h.engine.requests[-1]
    assert body["usage"]["input_tokens"] == len(request.prompt_token_ids)
    assert body["usage"]["output_tokens"] == len(
        h.engine.state.tokenizer.encode("Paris is sunny.", add_special_tokens=False))
    assert request.max_tokens == 64 and request.structured is None
    prompt = h.engine.state.tokenizer.decode(request.prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nParis?")
    # The client's own reading of it.
    done = _client(h).responses.create(model=h.model_name, input="Paris?", max_output_tokens=64)
    assert done.output_text == "Paris is sunny."


def test_a_conversation_with_calls_and_results_reaches_the_prompt(h: Harness) -> None:
    r = _post(h, tools=[WEATHER], input=[
        {"role": "user", "content": "Paris and Rome?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"}])
    assert r.status_code == 200, r.text
    prompt = h.engine.state.tokenizer.decode(h.engine.requests[-1].prompt_token_ids)
    # Both calls in one assistant turn, both results in one user turn.
    assert ("<|im_start|>assistant\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
            "</tool_call><|im_end|>") in prompt
    assert ("<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
            "</tool_response><|im_end|>") in prompt


def test_a_call_is_a_function_call_item(h: Harness) -> None:
    h.engine.state.answer = "Checking.\n" + CALL
    done = _client(h).responses.create(model=h.model_name, input="Paris?", tools=[WEATHER],
                                       max_output_tokens=64)  # type: ignore[list-item]
    message, call = done.output
    assert message.type == "message" and done.output_text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert h.engine.requests[-1].structured is not None  # each call held to its schema


def test_the_stream_is_the_responses_events(h: Harness) -> None:
    h.engine.state.answer = "Checking.\n" + CALL
    events = _events(_post(h, tools=[WEATHER], stream=True,
                           stream_options={"include_obfuscation": False}))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Checking."
    final = events[-1]["response"]
    assert final["status"] == "completed" and [i["type"] for i in final["output"]] == [
        "message", "function_call"]
    # The client's stream helper checks the events' order as it rebuilds the response.
    with _client(h).responses.stream(model=h.model_name, input="Paris?", tools=[WEATHER],
                                     max_output_tokens=64) as stream:  # type: ignore[list-item]
        for _ in stream:
            pass
        rebuilt = stream.get_final_response()
    assert rebuilt.output_text == "Checking." and rebuilt.output[1].name == "get_weather"


def test_a_cut_answer_is_incomplete(h: Harness) -> None:
    body = _post(h, max_output_tokens=3).json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    events = _events(_post(h, max_output_tokens=3, stream=True))
    assert events[-1]["type"] == "response.incomplete"


@pytest.mark.parametrize("fmt, kind", [
    ({"type": "json_object"}, "json_object"),
    ({"type": "json_schema", "name": "city", "strict": True,
      "schema": {"type": "object", "properties": {"city": {"type": "string"}}}}, "json_schema"),
])
def test_text_format_is_structured_output(h: Harness, fmt: dict[str, Any], kind: str) -> None:
    r = _post(h, text={"format": fmt})
    assert r.status_code == 200, r.text
    structured = h.engine.requests[-1].structured
    assert structured is not None and structured.kind == kind
    assert r.json()["text"]["format"]["type"] == fmt["type"]


def test_output_text_logprobs_as_included(h: Harness) -> None:
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: every
    token of the text with its alternatives, whole on the text part and
    piece by piece on the stream's deltas."""
    h.engine.state.answer = "Paris is sunny."
    plain = _post(h).json()
    assert plain["output"][0]["content"][0]["logprobs"] == []
    assert h.engine.requests[-1].logprobs is None
    body = _post(h, include=["message.output_text.logprobs"], top_logprobs=2).json()
    _valid(Response, body)
    assert h.engine.requests[-1].logprobs == 2
    lps = body["output"][0]["content"][0]["logprobs"]
    assert "".join(lp["token"] for lp in lps) == "Paris is sunny."
    assert len(lps) == body["usage"]["output_tokens"]
    assert all(lp["logprob"] == -0.25 and len(lp["top_logprobs"]) == 2 for lp in lps)
    assert lps[0]["top_logprobs"][0]["token"] == lps[0]["token"]
    events = _events(_post(h, include=["message.output_text.logprobs"], top_logprobs=2,
                           stream=True))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert all(len(e["logprobs"]) == 1 for e in deltas)  # one token a chunk here
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert [lp for e in deltas for lp in e["logprobs"]] == done["logprobs"] == lps
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == lps
    # top_logprobs alone asks for them too; 0 alternatives gives the tokens alone.
    only = _post(h, top_logprobs=0).json()["output"][0]["content"][0]["logprobs"]
    assert [lp["top_logprobs"] for lp in only] == [[]] * len(lps)


@pytest.mark.parametrize("extra, param", [
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"max_tool_calls": 0}, "max_tool_calls"),
    ({"input": []}, "input"),
    ({"input": [{"type": "computer_call", "action": {}}]}, "input.0"),
    # Named by the input's index and field: not the chat message it becomes
    # (`instructions` is the chat's first), nor the member of the item union.
    ({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "[1]"}]},
     "input.2.arguments"),
    ({"input": [{"role": "user", "content": 5}]}, "input.0.content"),
    ({"tools": [{**WEATHER, "parameters": {"type": "nope"}}]}, "tools.0.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"include": ["message.output_text.logprobs"], "tools": [WEATHER]}, "include"),
    ({"top_logprobs": 2, "tools": [WEATHER]}, "top_logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ({"prompt_cache_options": {"mode": "explicit"}}, "prompt_cache_options"),
    ({"moderation": {"input": {"mode": "block"}}}, "moderation"),
    ({"background_options": {"completion_window": "2h"}}, "background_options"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"image": {"context_compression": "enabled"}}, "image"),
    ({"access_programs": {"cyber": "standard"}}, "access_programs"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
])
def test_what_cannot_be_served_is_named(h: Harness, extra: dict[str, Any], param: str) -> None:
    before = len(h.engine.requests)
    r = _post(h, **extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param or error["param"].startswith(param + "."), error
    assert "messages" not in error["message"] and "max_tokens" not in error["message"]
    assert len(h.engine.requests) == before
    assert _post(h, model="other").status_code == 404
