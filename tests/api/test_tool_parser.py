"""An answer split into content and tool calls: the same whether it arrives
whole or one character at a time, nothing of a call leaking into the
streamed content, and whatever is not a complete call left as content."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from api.tool_parser import ToolCallParser
from api.tools import ToolDefinition, ToolUse

TOOLS = tuple(ToolDefinition.model_validate(
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}})
    for n in ("get_weather", "get_time"))


def _use(mode: str = "auto") -> ToolUse:
    return ToolUse(TOOLS, mode, "get_weather" if mode == "named" else None)


def _block(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def _run(text: str, pieces: list[str], reason: str = "stop", mode: str = "auto"
         ) -> tuple[str, list[dict[str, Any]], str | None, dict[str, Any]]:
    """Feed `pieces`; the streamed content, call deltas, finish reason and
    the message the same parser gives."""
    assert "".join(pieces) == text
    p = ToolCallParser(_use(mode))
    content, calls = "", []
    for piece in pieces:
        c, d = p.feed(piece)
        content, calls = content + c, calls + d
    rest, more, finish = p.finish(reason)
    return content + rest, calls + more, finish, p.message()


def _splits(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(8, len(text) - 1)))
    return [[text], list(text),
            [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]]


ANSWER = ("Let me look.\n" + _block("get_weather", {"city": "Paris"}) + "\n"
          + _block("get_time", {"tz": "Europe/Paris"}))


@pytest.mark.parametrize("seed", range(3))
def test_calls_and_content_do_not_depend_on_how_the_text_arrives(seed: int) -> None:
    seen = set()
    for pieces in _splits(ANSWER, seed):
        content, calls, finish, message = _run(ANSWER, pieces)
        assert content == "Let me look." == message["content"]
        assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in calls] == [(0, "get_weather", {"city": "Paris"}),
                                    (1, "get_time", {"tz": "Europe/Paris"})]
        assert [c["id"] for c in message["tool_calls"]] == [c["id"] for c in calls]
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
        assert finish == "tool_calls"
        seen.add(json.dumps(message["tool_calls"][0]["function"]))
    assert len(seen) == 1


def test_an_answer_without_calls_is_its_text_exactly() -> None:
    text = "if a <tool or a < b then <tool_ca\n\n"
    for pieces in _splits(text, 0):
        content, calls, finish, message = _run(text, pieces)
        assert content == text == message["content"]
        assert calls == [] and finish == "stop" and "tool_calls" not in message


def test_only_calls_means_no_content() -> None:
    text = _block("get_time", {"tz": "UTC"}) + "\n"
    content, calls, finish, message = _run(text, list(text))
    assert content == "" and message["content"] is None and len(calls) == 1
    assert finish == "tool_calls"


@pytest.mark.parametrize("block", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by max_tokens
    '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',  # not a tool
    '<tool_call>\n{"name": "get_time", "arguments": "UTC"}\n</tool_call>',  # not an object
    "<tool_call>\nnot json\n</tool_call>",
])
def test_what_is_not_a_complete_call_stays_content(block: str) -> None:
    text = "Hm. " + block
    content, calls, finish, message = _run(text, list(text), reason="length")
    assert calls == [] and content == text == message["content"]
    assert finish == "length"  # a cut answer says so, calls or not


def test_a_cut_call_after_a_complete_one() -> None:
    text = _block("get_time", {"tz": "UTC"}) + "\n<tool_call>\n{\"na"
    content, calls, finish, message = _run(text, list(text), reason="length")
    assert len(calls) == 1 and content == '<tool_call>\n{"na' == message["content"]
    assert finish == "length"


def test_a_named_choice_streams_its_arguments() -> None:
    args = '{"city": "Rome", "unit": "celsius"}'
    pieces = ['{"', "city", '": "', "Rome", '", "unit": "celsius"}']
    content, calls, finish, message = _run(args, pieces, mode="named")
    assert content == "" and finish == "stop"  # OpenAI's reason for a forced function
    head, *rest = calls
    assert head["function"]["name"] == "get_weather" and head["index"] == 0
    assert "".join(c["function"]["arguments"] for c in calls) == args
    assert all(set(c) == {"index", "function"} for c in rest)
    assert message == {"content": None, "tool_calls": [
        {"id": head["id"], "type": "function",
         "function": {"name": "get_weather", "arguments": args}}]}


def test_a_named_choice_with_no_output_still_names_its_call() -> None:
    content, calls, finish, message = _run("", [], reason="length", mode="named")
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": ""}]
    assert message["tool_calls"][0]["function"]["arguments"] == "" and finish == "length"
