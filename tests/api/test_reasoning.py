"""A reasoning model's answers (`reasoning_parser`, api/reasoning.py): the
reasoning apart from the content on chat completions, whole and streamed,
with tool calls read from the content, its tokens counted, and grammars
that would bind the reasoning refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from api.reasoning import CLOSE, ReasoningParser, ReasoningTally, split_reasoning
from tests.api.harness import Harness, harness

ANSWER = "<think>\nThe user asks for a capital.</think>\n\nParis."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
MSGS = [{"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def r1() -> Iterator[Harness]:
    with harness(max_model_len=4096, reasoning_parser="deepseek_r1") as h:
        yield h


@pytest.fixture
def h(r1: Harness) -> Iterator[Harness]:
    yield r1
    r1.engine.state.answer = None


def _chat(h: Harness, **body: Any) -> Any:
    r = h.client.post("/v1/chat/completions", json={
        "model": h.model_name, "max_tokens": 64, "messages": MSGS, **body})
    if not body.get("stream"):
        return r
    assert r.status_code == 200, r.text
    raw = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    return [json.loads(e) for e in raw[:-1]]


@pytest.mark.parametrize("fmt", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", [ANSWER, "No tags: all reasoning for R1.",
                                  "Thinking...</think> Done.", "<think>cut short",
                                  "  <thi", "a < b <th", "<think></think>\n\nOnly this."])
def test_streamed_pieces_split_as_the_whole_does(fmt: str, text: str) -> None:
    whole = split_reasoning(text, fmt)  # type: ignore[arg-type]
    for step in (1, 2, 3, 5, 8):
        p = ReasoningParser(fmt)  # type: ignore[arg-type]
        parts = [p.feed(text[i:i + step]) for i in range(0, len(text), step)] + [p.finish()]
        got = ("".join(r for r, _ in parts) if p.reasoned else None,
               "".join(c for _, c in parts))
        assert got == whole, (step, got, whole)
    if text == ANSWER:
        assert whole == ("\nThe user asks for a capital.", "Paris.")
    if text.startswith("No tags"):
        assert whole == ((text, "") if fmt == "deepseek_r1" else (None, text))


def reasoning_token_count(texts: list[str]) -> int:
    """The reference: how many of an answer's tokens (their texts, in order)
    its reasoning took, up to the one that completes `</think>`."""
    for i in range(len(texts)):
        if CLOSE in "".join(texts[:i + 1]):
            return i + 1
    return len(texts)


def test_reasoning_tokens_end_with_the_closing_tag() -> None:
    assert reasoning_token_count(["<think>", "a", "</", "think", ">", "\n\n", "b"]) == 5
    assert reasoning_token_count(["a", "b"]) == 2


@pytest.mark.parametrize("fmt", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("tokens", [
    ["<think>", "a", "</", "think", ">", "\n\n", "b"], ["No", " tags"], ["  ", "<thi"],
    ["<th", "ink>", "cut"], ["x", "</think>", "y", "z"], ["Hello"]])
def test_the_usage_tally_counts_a_growing_answer_as_the_whole(fmt: str,
                                                              tokens: list[str]) -> None:
    """The usage of every chunk (`continuous_usage_stats`): each prefix of
    the answer counted as if it were the whole, each token read once."""
    tally = ReasoningTally(fmt)  # type: ignore[arg-type]
    read: list[int] = []

    def texts(k: int) -> list[str]:
        read.extend(range(k, n))
        return tokens[k:n]

    for n in range(len(tokens) + 1):
        pieces = tokens[:n]
        whole = split_reasoning("".join(pieces), fmt)  # type: ignore[arg-type]
        want = reasoning_token_count(pieces) if whole[0] is not None else 0
        assert tally.count(pieces, texts, n) == want, (n, whole)
        assert tally.count(pieces, texts, n) == want  # asked again: nothing reread
    assert len(read) == len(set(read))


def test_a_chat_answer_carries_its_reasoning_apart(h: Harness) -> None:
    h.engine.state.answer = ANSWER
    out = _chat(h).json()
    message = out["choices"][0]["message"]
    assert message["content"] == "Paris."
    assert message["reasoning"] == message["reasoning_content"] == \
        "\nThe user asks for a capital."
    tok = h.engine.state.tokenizer
    ids = tok(ANSWER, add_special_tokens=False)["input_ids"]
    want = reasoning_token_count([tok.decode([t]) for t in ids])
    assert 0 < want < len(ids)
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": want}
    # Streamed, one token a chunk: the same two texts, nothing of the tags.
    events = _chat(h, stream=True, stream_options={"include_usage": True})
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
    assert all(d.get("reasoning_content") == d.get("reasoning") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "Paris."
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": want}


def test_tool_calls_are_read_from_the_content(h: Harness) -> None:
    h.engine.state.answer = "<think>I need the weather.</think>\n" + CALL
    out = _chat(h, tools=[WEATHER]).json()["choices"][0]
    assert out["finish_reason"] == "tool_calls"
    assert out["message"]["reasoning"] == "I need the weather."
    assert [c["function"]["name"] for c in out["message"]["tool_calls"]] == ["get_weather"]
    events = _chat(h, tools=[WEATHER], stream=True)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == "I need the weather."
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == \
        ["get_weather"]


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
])
def test_grammars_that_would_bind_the_reasoning_are_refused(
        h: Harness, body: dict[str, Any], param: str) -> None:
    r = _chat(h, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "reasoning_parser" in r.json()["error"]["message"]
    assert _chat(h, response_format={"type": "text"}).status_code == 200


def test_responses_carry_a_reasoning_item_before_the_message(h: Harness) -> None:
    from openai import OpenAI

    h.engine.state.answer = ANSWER
    client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=h.client)
    resp = client.responses.create(model=h.model_name, input="Capital?", store=False)
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "\nThe user asks for a capital."
    assert resp.output_text == "Paris."
    assert resp.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(model=h.model_name, input="Capital?", store=False,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == resp.output[0].content[0].text
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    # The output sent back as input: the reasoning item is accepted and left
    # out of the prompt.
    h.engine.state.answer = "Lyon."
    replay = [{"role": "user", "content": "Capital?"},
              *[o.model_dump(exclude_none=True) for o in resp.output],
              {"role": "user", "content": "And the second city?"}]
    client.responses.create(model=h.model_name, input=replay, store=False)
    with_reasoning = h.engine.requests[-1].prompt_token_ids
    client.responses.create(model=h.model_name, store=False,
                            input=[replay[0], replay[2], replay[3]])
    assert h.engine.requests[-1].prompt_token_ids == with_reasoning


def test_without_a_parser_the_answer_is_as_written(wide: Harness) -> None:
    wide.engine.state.answer = ANSWER
    out = _chat(wide).json()
    assert out["choices"][0]["message"]["content"] == ANSWER
    assert "reasoning" not in out["choices"][0]["message"]
    assert "completion_tokens_details" not in out["usage"]


anthropic = pytest.importorskip("anthropic")


def _client(h: Harness) -> Any:
    return anthropic.Anthropic(base_url="http://testserver", api_key="unused",
                               http_client=h.client)


def test_messages_return_the_reasoning_as_a_thinking_block_when_asked(h: Harness) -> None:
    h.engine.state.answer = ANSWER
    client = _client(h)
    asked = client.messages.create(model=h.model_name, max_tokens=2048, messages=MSGS,
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in asked.content] == ["thinking", "text"]
    assert asked.content[0].thinking == "\nThe user asks for a capital."
    assert asked.content[1].text == "Paris."
    # Not asked: the answer only, the reasoning not shown.
    plain = client.messages.create(model=h.model_name, max_tokens=64, messages=MSGS)
    assert [(b.type, b.text) for b in plain.content] == [("text", "Paris.")]
    # Streamed: a thinking block (deltas, then its signature), then the text.
    with client.messages.stream(model=h.model_name, max_tokens=2048, messages=MSGS,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == asked.content[0].thinking
    assert final.content[1].text == "Paris." and "signature" in kinds


def test_thinking_needs_a_reasoning_model_and_a_budget_below_max_tokens(
        h: Harness, wide: Harness) -> None:
    with pytest.raises(anthropic.BadRequestError, match="reasoning_parser"):
        _client(wide).messages.create(model=wide.model_name, max_tokens=2048, messages=MSGS,
                                      thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.BadRequestError, match="less than max_tokens"):
        _client(h).messages.create(model=h.model_name, max_tokens=1024, messages=MSGS,
                                   thinking={"type": "enabled", "budget_tokens": 1024})


def test_thinking_blocks_sent_back_are_left_out_of_the_prompt(h: Harness) -> None:
    """Anthropic's clients send an answer's thinking back with its tool use;
    the prompt is the same without it."""
    h.engine.state.answer = "Done."
    client = _client(h)
    turns: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I need the weather.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "-3 C"}]}]
    tool = {"name": "get_weather", "input_schema": {"type": "object"}}
    client.messages.create(model=h.model_name, max_tokens=2048, messages=turns,
                           tools=[tool], thinking={"type": "enabled", "budget_tokens": 1024})
    with_thinking = h.engine.requests[-1].prompt_token_ids
    counted = client.messages.count_tokens(model=h.model_name, messages=turns, tools=[tool],
                                           thinking={"type": "enabled", "budget_tokens": 1024})
    assert counted.input_tokens == len(with_thinking)
    turns[1]["content"] = turns[1]["content"][1:]
    client.messages.create(model=h.model_name, max_tokens=2048, messages=turns,
                           tools=[tool], thinking={"type": "enabled", "budget_tokens": 1024})
    assert h.engine.requests[-1].prompt_token_ids == with_thinking
    with pytest.raises(anthropic.BadRequestError, match="assistant messages"):
        client.messages.create(model=h.model_name, max_tokens=64, messages=[
            {"role": "user", "content": [{"type": "thinking", "thinking": "x",
                                          "signature": ""}]}])
