"""Tool-call formats (`api/tool_formats.py`): which one a chat template
teaches, and Llama 3's bare JSON calls read back from an answer as it
streams, whatever its pieces."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from api.tool_formats import HERMES, LLAMA3_JSON, tool_format
from api.tool_parser import ToolCallParser
from api.tool_prompt import tools_instructions
from api.tools import ToolDefinition, ToolUse

TOOLS = tuple(ToolDefinition.model_validate(
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}})
    for n in ("get_weather", "get_time"))
QWEN = "{% if tools %}<tools>{{ tools }}</tools> ... <tool_call>{% endif %}"
LLAMA = ('{% if tools %}Respond in the format {"name": function name, "parameters": '
         "dictionary of argument name and its value}.{{ tools }}{% endif %}<|python_tag|>")


@pytest.mark.parametrize("name,template,want", [
    ("auto", None, HERMES),
    ("auto", "{{ messages }}", HERMES),  # renders no tools: the prompt teaches Hermes
    ("auto", QWEN, HERMES),
    ("auto", LLAMA, LLAMA3_JSON),
    ("auto", "{% if tools %}{{ tools }}{% endif %}", HERMES),
    ("hermes", LLAMA, HERMES),
    ("llama3_json", None, LLAMA3_JSON),
])
def test_the_format_is_the_one_the_template_teaches(name, template, want) -> None:
    assert tool_format(name, template) is want


def test_a_call_reads_back_as_written_and_only_in_its_format() -> None:
    for fmt in (HERMES, LLAMA3_JSON):
        text = fmt.write("get_weather", {"city": "Oslo", "n": [1, {"}": "{"}]})
        assert text.startswith(fmt.trigger) and fmt.call_end(text + "; x") == len(text)
        assert fmt.read(text) == ("get_weather", {"city": "Oslo", "n": [1, {"}": "{"}]})
        assert fmt.call_end(text[:-1]) == -1  # not complete yet
    assert LLAMA3_JSON.read('{"name": "f", "arguments": {}}') is None
    assert LLAMA3_JSON.read('{"name": "f", "parameters": [1]}') is None


def _call(name: str, args: dict[str, Any]) -> str:
    return json.dumps({"name": name, "parameters": args})


def _run(text: str, pieces: list[str], mode: str = "auto"
         ) -> tuple[str, list[dict[str, Any]], str | None, dict[str, Any]]:
    assert "".join(pieces) == text
    p = ToolCallParser(ToolUse(TOOLS, mode, fmt=LLAMA3_JSON))
    content, calls = "", []
    for piece in pieces:
        c, d = p.feed(piece)
        content, calls = content + c, calls + d
    rest, more, finish = p.finish("stop")
    return content + rest, calls + more, finish, p.message()


def _splits(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = [[text], list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def test_llama3_calls_stream_out_of_the_content_whatever_the_pieces() -> None:
    text = ("Checking both. " + _call("get_weather", {"city": "Paris"}) + "; "
            + _call("get_time", {"tz": "Europe/Rome"}))
    for pieces in _splits(text, 1):
        content, calls, finish, message = _run(text, pieces)
        assert content == "Checking both." and finish == "tool_calls"
        assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [
            {"city": "Paris"}, {"tz": "Europe/Rome"}]
        assert [c["index"] for c in calls] == [0, 1]
        assert message["content"] == "Checking both."


def test_a_long_call_streamed_in_small_pieces_is_read_whole_only_where_it_can_close(
        monkeypatch) -> None:
    """Reading the open call again for every piece costs the square of its
    length: a call is parsed only when a piece brings a '}'."""
    import api.tool_formats as formats

    reads = []

    class Counting(json.JSONDecoder):
        def raw_decode(self, s, idx=0):
            reads.append(len(s))
            return super().raw_decode(s, idx)

    monkeypatch.setattr(formats, "_JSON", Counting())
    text = _call("get_weather", {"city": "x" * 4000, "opts": {"u": "c"}})
    content, calls, _, _ = _run(text, list(text))
    assert content == "" and json.loads(calls[0]["function"]["arguments"])["city"] == "x" * 4000
    assert len(reads) == text.count("}")
    # Hermes: its end tag is found whatever the pieces it streams in.
    p = ToolCallParser(ToolUse(TOOLS, "auto", fmt=HERMES))
    text = HERMES.write("get_time", {"tz": "y" * 300})
    got = [d for ch in text for d in p.feed(ch)[1]]
    assert [json.loads(d["function"]["arguments"]) for d in got] == [{"tz": "y" * 300}]


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Par',  # cut short by max_tokens
    '{"name": "nope", "parameters": {}}',  # not one of the tools
    '{"name": "get_weather", "arguments": {}}',  # Hermes' key, not Llama's
    'I would write {"name": x} here.',
])
def test_what_is_not_a_whole_llama3_call_stays_content(text: str) -> None:
    for pieces in _splits(text, 2):
        content, calls, finish, message = _run(text, pieces)
        assert calls == [] and content == text and finish == "stop"
        assert message == {"content": text}


def test_the_prompt_teaches_the_format_it_will_be_held_to() -> None:
    hermes = tools_instructions(ToolUse(TOOLS, "auto"))
    llama = tools_instructions(ToolUse(TOOLS, "auto", fmt=LLAMA3_JSON))
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n' \
           "</tool_call>" in hermes
    assert '{"name": <function-name>, "parameters": <args-json-object>}' in llama
    assert "<tool_call>" not in llama
