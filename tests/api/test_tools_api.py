"""Tool calling on the wire: what each `tool_choice` asks of the engine,
how the tools and an earlier call reach the prompt, answers read back as
`tool_calls` (whole and streamed), and a 400 naming the field for what
cannot be served."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.api.harness import Harness

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def h(wide: Harness) -> Harness:
    return wide


def _chat(h: Harness, **extra: Any) -> Any:
    body = {"model": h.model_name, "messages": [{"role": "user", "content": "Paris?"}],
            "max_tokens": 64, **extra}
    return h.client.post("/v1/chat/completions", json=body)


def _prompt(h: Harness) -> str:
    return str(h.engine.state.tokenizer.decode(h.engine.requests[-1].prompt_token_ids))


def _format(h: Harness) -> dict[str, Any]:
    so = h.engine.requests[-1].structured
    assert so is not None and so.kind == "structural_tag" and so.spec
    return json.loads(so.spec)["format"]


def test_auto_lets_the_model_choose_and_holds_each_call_to_its_schema(h: Harness) -> None:
    assert _chat(h, tools=[WEATHER, TIME]).status_code == 200
    fmt = _format(h)
    assert fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<tool_call>"]
    assert not fmt["at_least_one"] and not fmt["stop_after_first"]
    weather, time = fmt["tags"]
    assert weather["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert weather["content"]["json_schema"] == WEATHER["function"]["parameters"]
    # No parameters: OpenAI's empty parameter list.
    assert time["content"]["json_schema"]["properties"] == {}
    # The template renders no tools: the system message describes them.
    prompt = _prompt(h)
    assert prompt.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in prompt


def test_required_and_parallel_calls(h: Harness) -> None:
    assert _chat(h, tools=[WEATHER], tool_choice="required").status_code == 200
    fmt = _format(h)
    assert fmt["type"] == "tags_with_separator" and fmt["at_least_one"]
    assert not fmt["stop_after_first"]
    assert _chat(h, tools=[WEATHER], tool_choice="required",
                 parallel_tool_calls=False).status_code == 200
    assert _format(h)["stop_after_first"]


def test_a_named_function_constrains_the_answer_to_its_arguments(h: Harness) -> None:
    assert _chat(h, tools=[WEATHER, TIME], tool_choice=NAMED).status_code == 200
    so = h.engine.requests[-1].structured
    assert so is not None and so.kind == "json_schema"
    assert json.loads(so.spec or "") == WEATHER["function"]["parameters"]
    assert "Call get_weather now" in _prompt(h)


def test_none_offers_no_tool(h: Harness) -> None:
    assert _chat(h, tools=[WEATHER], tool_choice="none").status_code == 200
    assert h.engine.requests[-1].structured is None and "<tools>" not in _prompt(h)
    assert _chat(h).status_code == 200 and "<tools>" not in _prompt(h)


def test_an_earlier_call_and_its_result_reach_the_prompt(h: Harness) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
                {"role": "tool", "content": '{"wind": 3}', "tool_call_id": "call_1"}]
    assert _chat(h, messages=messages, tools=[WEATHER]).status_code == 200
    prompt = _prompt(h)
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>" in prompt
    # Results are the user's turn, one turn for consecutive results.
    assert ('<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
            '<tool_response>\n{"wind": 3}\n</tool_response><|im_end|>') in prompt


def test_an_answer_with_a_call_is_read_as_tool_calls(h: Harness) -> None:
    h.engine.state.answer = "Checking.\n" + CALL
    r = _chat(h, tools=[WEATHER])
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking."
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["type"] == "function" and call["id"].startswith("call_")


def test_streamed_calls_come_whole_after_the_content(h: Harness) -> None:
    h.engine.state.answer = "Checking.\n" + CALL
    r = _chat(h, tools=[WEATHER], stream=True)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert content == "Checking." and "<tool" not in content
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_named_call_streams_its_arguments(h: Harness) -> None:
    args = '{"city": "Rome"}'
    h.engine.state.answer = args
    r = _chat(h, tools=[WEATHER], tool_choice=NAMED, stream=True, n=2)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        calls = [tc for c in mine for tc in c["delta"].get("tool_calls", [])]
        assert calls[0]["function"]["name"] == "get_weather" and len(calls) > 2
        assert "".join(c["function"]["arguments"] for c in calls) == args
        assert mine[-1]["finish_reason"] == "stop"
    whole = _chat(h, tools=[WEATHER], tool_choice=NAMED).json()["choices"][0]
    assert whole["message"]["content"] is None and whole["finish_reason"] == "stop"
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == args


@pytest.mark.parametrize("extra, param, words", [
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name", "pattern"),
    ({"tools": [TIME, {"type": "function", "function": {
        "name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools.1.function.parameters", "nonsense"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0.type", "function"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format",
     "tools"),
    ({"tools": [WEATHER], "min_tokens": 3}, "min_tokens", "tools"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}],
      "tools": [WEATHER]}, "messages.0.tool_calls.0.function.arguments", "JSON object"),
    ({"functions": [{"name": "f"}]}, "functions", "tools"),
])
def test_what_cannot_be_served_is_named(h: Harness, extra: dict[str, Any], param: str,
                                        words: str) -> None:
    before = len(h.engine.requests)
    r = _chat(h, **extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert len(h.engine.requests) == before


def test_completions_take_no_tools(h: Harness) -> None:
    r = h.client.post("/v1/completions", json={"model": h.model_name, "prompt": "x",
                                                "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_a_batch_line_with_tools_answers_with_calls(h: Harness) -> None:
    import asyncio

    h.engine.state.answer = CALL
    out = asyncio.run(h.ingress.batch_request("/v1/chat/completions", {
        "model": h.model_name, "messages": [{"role": "user", "content": "Paris?"}],
        "tools": [WEATHER], "tool_choice": "required", "max_tokens": 64}))
    assert out["status_code"] == 200, out
    choice = out["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


@pytest.fixture(scope="module")
def llama() -> Any:
    from tests.api.harness import harness

    with harness(max_model_len=1024, tool_call_format="llama3_json") as h:
        yield h


def test_llama3_json_format_end_to_end(llama: Harness) -> None:
    """`tool_call_format: llama3_json`: the grammar, the prompt (earlier calls
    included) and the answer read back all in Llama 3's bare JSON calls."""
    earlier = [{"role": "user", "content": "Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
               {"role": "user", "content": "And Rome?"}]
    llama.engine.state.answer = 'Sure. {"name": "get_weather", "parameters": {"city": "Rome"}}'
    try:
        r = llama.client.post("/v1/chat/completions", json={
            "model": llama.model_name, "messages": earlier, "tools": [WEATHER],
            "max_tokens": 64})
    finally:
        llama.engine.state.answer = None
    assert r.status_code == 200, r.text
    fmt = _format(llama)
    assert fmt["triggers"] == ['{"name":']
    assert fmt["tags"][0]["begin"] == '{"name": "get_weather", "parameters": '
    prompt = _prompt(llama)
    assert '"parameters": <args-json-object>}' in prompt and "<tool_call>" not in prompt
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in prompt
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_an_unknown_tool_call_format_fails_the_config_by_name() -> None:
    from pydantic import ValidationError

    from api.config import AppConfig

    with pytest.raises(ValidationError, match="tool_call_format"):
        AppConfig(model="embedded:smollm2", tool_call_format="mistral")
