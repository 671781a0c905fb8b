"""Anthropic's Messages API (`/v1/messages`, deployments/messages_route.py)
on the real ingress app without Ray, through the `anthropic` client as its
users call it, and the conversion to the chat request underneath."""

from __future__ import annotations

import json
from typing import Any

import pytest

from api.messages_api import MessagesRequest
from tests.api.harness import Harness

anthropic = pytest.importorskip("anthropic")

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "required": ["city"],
                            "properties": {"city": {"type": "string"}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def h(wide: Harness) -> Harness:
    return wide


@pytest.fixture
def client(h: Harness) -> Any:
    return anthropic.Anthropic(base_url="http://testserver", api_key="unused",
                               http_client=h.client)


def _prompt(h: Harness) -> str:
    return str(h.engine.state.tokenizer.decode(h.engine.requests[-1].prompt_token_ids))


def test_a_message_answers_in_anthropic_shape(client: Any, h: Harness) -> None:
    h.engine.state.answer = "Hello there."
    msg = client.messages.create(model=h.model_name, max_tokens=32, system="Be brief.",
                                 messages=[{"role": "user", "content": "Hi"}],
                                 metadata={"user_id": "u1"},
                                 # Older clients send it; this one no longer takes it.
                                 extra_body={"temperature": 0.5})
    assert msg.type == "message" and msg.role == "assistant" and msg.model == h.model_name
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Hello there."
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.input_tokens == len(h.engine.requests[-1].prompt_token_ids)
    assert msg.usage.output_tokens > 0
    req = h.engine.requests[-1]
    assert req.temperature == 0.5 and req.max_tokens == 32
    assert "Be brief." in _prompt(h) and "Hi" in _prompt(h)
    cut = client.messages.create(model=h.model_name, max_tokens=2,
                                 messages=[{"role": "user", "content": "Hi"}])
    assert cut.stop_reason == "max_tokens"


def test_a_stop_sequence_ends_the_answer_and_is_named_streamed_or_not(client: Any,
                                                                       h: Harness) -> None:
    # " STOP" is two tokens: nothing of it reaches the client.
    h.engine.state.answer = "one, two, STOP three"
    msg = client.messages.create(model=h.model_name, max_tokens=64, stop_sequences=[" STOP"],
                                 messages=[{"role": "user", "content": "Count"}])
    assert h.engine.requests[-1].stop == [" STOP"]
    assert msg.content[0].text == "one, two," and msg.stop_reason == "stop_sequence"
    assert msg.stop_sequence == " STOP"
    with client.messages.stream(model=h.model_name, max_tokens=64, stop_sequences=[" STOP"],
                                messages=[{"role": "user", "content": "Count"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "one, two," and final.stop_reason == "stop_sequence"
    assert final.stop_sequence == " STOP" and final.content[0].text == "one, two,"
    msg = client.messages.create(model=h.model_name, max_tokens=64, stop_sequences=["four"],
                                 messages=[{"role": "user", "content": "Count"}])
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.content[0].text == "one, two, STOP three"


def test_streamed_events_follow_anthropic_order(client: Any, h: Harness) -> None:
    h.engine.state.answer = "A streamed answer."
    with client.messages.stream(model=h.model_name, max_tokens=32,
                                messages=[{"role": "user", "content": "Go"}]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.index("content_block_start") < kinds.index("content_block_stop") \
        < kinds.index("message_delta")
    assert final.content[0].text == "A streamed answer." and final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0


def test_tools_round_trip_as_tool_use_and_tool_result(client: Any, h: Harness) -> None:
    pytest.importorskip("xgrammar")
    h.engine.state.answer = "Checking.\n" + CALL
    msg = client.messages.create(model=h.model_name, max_tokens=64, tools=[WEATHER],
                                 messages=[{"role": "user", "content": "Paris?"}])
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    use = msg.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    assert msg.stop_reason == "tool_use"
    with client.messages.stream(model=h.model_name, max_tokens=64, tools=[WEATHER],
                                messages=[{"role": "user", "content": "Paris?"}]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    # The result goes back as the model's template reads a tool's answer.
    h.engine.state.answer = "It is sunny."
    msg = client.messages.create(model=h.model_name, max_tokens=64, tools=[WEATHER],
                                 tool_choice={"type": "auto"}, messages=[
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id,
                                           "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "sunny, 21 C"}]}])
    assert msg.content[0].text == "It is sunny." and "sunny, 21 C" in _prompt(h)
    forced = client.messages.create(model=h.model_name, max_tokens=64, tools=[WEATHER],
                                    tool_choice={"type": "any"},
                                    messages=[{"role": "user", "content": "Paris?"}])
    assert forced.model == h.model_name  # served: `required` underneath
    assert h.engine.requests[-1].structured is not None


def test_count_tokens_counts_the_prompt_the_message_would_have(client: Any,
                                                               h: Harness) -> None:
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    counted = client.messages.count_tokens(model=h.model_name, system="Be brief.",
                                           messages=messages)
    client.messages.create(model=h.model_name, max_tokens=4, system="Be brief.",
                           messages=messages)
    assert counted.input_tokens == len(h.engine.requests[-1].prompt_token_ids)


def test_errors_have_anthropic_shape_and_name_the_field(client: Any, h: Harness) -> None:
    def post(body: dict[str, Any]) -> Any:
        return h.client.post("/v1/messages", json=body)

    base = {"model": h.model_name, "max_tokens": 8,
            "messages": [{"role": "user", "content": "x"}]}
    for body, status, words in (
            ({k: v for k, v in base.items() if k != "max_tokens"}, 400, "max_tokens"),
            ({**base, "model": "nope"}, 404, "nope"),
            ({**base, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking"),
            ({**base, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {}}]}]}, 400, "'image' is not supported"),
            ({**base, "tool_choice": {"type": "tool", "name": "x"}}, 400, "needs tools"),
            ({**base, "max_tokens": 10**6}, 400, "max_tokens")):
        r = post(body)
        assert r.status_code == status, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and words in err["error"]["message"], err
        assert err["error"]["type"] == ("not_found_error" if status == 404
                                        else "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=4,
                               messages=[{"role": "user", "content": "x"}])


def test_refusals_of_the_chat_request_underneath_name_the_messages_fields(h: Harness) -> None:
    base = {"model": h.model_name, "max_tokens": 8,
            "messages": [{"role": "user", "content": "x"}]}
    lookbehind = {"type": "object", "properties": {"a": {"type": "string",
                                                          "pattern": "(?<=a)b"}}}
    fmt = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
    before = len(h.engine.requests)
    for extra, named in (
            ({"stop_sequences": [str(i) for i in range(5)]}, "stop_sequences: "),
            ({"tools": [{**WEATHER, "input_schema": lookbehind}]}, "tools.0.input_schema: "),
            ({"tools": [WEATHER], "output_config": fmt}, "output_config.format cannot")):
        r = h.client.post("/v1/messages", json={**base, **extra})
        assert r.status_code == 400, (extra, r.text)
        message = r.json()["error"]["message"]
        assert message.startswith(named) or named in message, message
        assert "response_format" not in message and ".function." not in message, message
    assert len(h.engine.requests) == before


def test_conversion_keeps_turn_order_and_cache_control_is_accepted() -> None:
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5,
        "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                              {"type": "tool_use", "id": "t1", "name": "f",
                                               "input": {"x": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "r"}],
                                          "is_error": True},
                                         {"type": "text", "text": "and?"}]}]})
    body = req.chat_body()
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert body["messages"][2]["tool_calls"][0]["function"] == {"name": "f",
                                                                "arguments": json.dumps({"x": 1})}
    assert body["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "Error: r"}


def test_anthropic_clients_list_models_in_their_shape(client: Any, h: Harness) -> None:
    models = list(client.models.list())
    assert [m.id for m in models] == [h.model_name] and models[0].type == "model"
    assert client.models.retrieve(h.model_name).display_name == h.model_name
    # Without Anthropic's header: OpenAI's shape, as before.
    assert h.client.get("/v1/models").json()["object"] == "list"


def test_refusals_name_the_message_as_sent(h: Harness) -> None:
    """Indices are the request's own, whatever the chat request underneath
    (a system prompt before the turns, tool results fanned out into several
    messages), and `count_tokens` refuses what `/v1/messages` refuses, with
    a 400, not an error of the server."""
    results = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "r1"},
        {"type": "tool_result", "tool_use_id": "t2", "content": "r2"}]}
    calls = {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
        {"type": "tool_use", "id": "t2", "name": "f", "input": {}}]}
    user = {"role": "user", "content": "x"}
    before = len(h.engine.requests)
    for messages, named in (
            ([user, calls, results, {"role": "assistant", "content": []}, user],
             "messages.3: all messages must have non-empty content"),
            ([user, {"role": "assistant", "content": [{"type": "text", "text": ""}]}, user],
             "messages.1: all messages must have non-empty content"),
            ([{"role": "user", "content": ""}], "messages.0: all messages"),
            ([user, calls, results, {"role": "assistant", "content": "Sunny "}],
             "messages.3: final assistant content cannot end with trailing whitespace"),
            ([user, {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                  "input": {}}]}],
             "messages.1.content.0: tool_use blocks belong to assistant messages"),
            ([user, {"role": "assistant", "content": [
                {"type": "text", "text": "a"},
                {"type": "tool_result", "tool_use_id": "t", "content": "r"}]}, user],
             "messages.1.content.1: tool_result blocks belong to user messages"),
            ([user, {"role": "assistant", "content": [{"type": "tool_use", "name": "f",
                                                       "input": {}}]}, user],
             "messages.1.content.0.id: Field required")):
        for path, extra in (("/v1/messages", {"max_tokens": 8}),
                            ("/v1/messages/count_tokens", {})):
            r = h.client.post(path, json={"model": h.model_name, "system": "Be brief.",
                                          "messages": messages, **extra})
            assert r.status_code == 400, (path, messages, r.text)
            message = r.json()["error"]["message"]
            assert named in message and "[" not in message, (path, message)
    assert len(h.engine.requests) == before


def test_an_empty_final_assistant_message_is_no_prefill(h: Harness) -> None:
    h.engine.state.answer = "Fine."
    for last in ([], "", [{"type": "thinking", "thinking": "hm", "signature": "s"}]):
        r = h.client.post("/v1/messages", json={
            "model": h.model_name, "max_tokens": 8,
            "messages": [{"role": "user", "content": "How are you?"},
                         {"role": "assistant", "content": last}]})
        assert r.status_code == 200, r.text
        assert r.json()["content"][0]["text"] == "Fine."
        # The answer starts afresh: its turn opens after the question.
        assert _prompt(h).endswith("How are you?<|im_end|>\n<|im_start|>assistant\n"), _prompt(h)
