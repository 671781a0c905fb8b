"""Tool calls on the real SmolLM2 (float32): under each `tool_choice` the
answer reads back as calls whose arguments follow their function's schema,
and the tokens are the same when the requests are preempted and recomputed
in between."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from api.protocol import ChatCompletionRequest
from api.tool_formats import HERMES, LLAMA3_JSON, ToolFormat
from api.tool_parser import ToolCallParser
from api.tool_prompt import chat_prompt
from api.tools import ToolUse, tool_use
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.tokenizer import encode_chat_text
from tests.engine.helpers import drive

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"type": "string", "enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a timezone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["tz"],
                   "properties": {"tz": {"type": "string", "maxLength": 20}}}}}
NAMED = {"type": "function", "function": {"name": "get_time"}}
ASKS: dict[str, tuple[dict[str, Any], str]] = {
    "required": ({"tool_choice": "required", "parallel_tool_calls": False},
                 "Weather in Paris?"),
    "named": ({"tool_choice": NAMED}, "What time is it in Tokyo?"),
    "auto": ({}, "Say hello."),
    # Parallel calls, sampled: the grammar holds under temperature too.
    "many": ({"tool_choice": "required", "temperature": 0.8, "seed": 5},
             "Weather in Paris and Rome?"),
}


@pytest.fixture(scope="module")
def runner(smollm2_path: Path) -> ModelRunner:
    return ModelRunner(smollm2_path, "float32", "cpu", num_blocks=100, block_size=16,
                       max_model_len=384, num_threads=1)


def _requests(runner: ModelRunner, fmt: ToolFormat = HERMES
              ) -> tuple[dict[str, list[int]], dict[str, SamplingParams], dict[str, ToolUse]]:
    prompts, params, uses = {}, {}, {}
    for name, (extra, question) in ASKS.items():
        req = ChatCompletionRequest.model_validate({
            "messages": [{"role": "user", "content": question}], "tools": [WEATHER, TIME],
            "temperature": 0.0, **extra})
        use = tool_use(req, fmt)
        assert use is not None
        text = chat_prompt(req, runner.tokenizer, tools=use)
        prompts[name] = encode_chat_text(runner.tokenizer, text)
        params[name] = SamplingParams(temperature=req.temperature, seed=req.seed,
                                      max_tokens=48, structured=use.structure())
        uses[name] = use
    return prompts, params, uses


def _valid(name: str, arguments: dict[str, Any]) -> bool:
    if name == "get_weather":
        return set(arguments) == {"city", "unit"} and arguments["unit"] in ("C", "F") \
            and isinstance(arguments["city"], str) and len(arguments["city"]) <= 20
    return set(arguments) == {"tz"} and isinstance(arguments["tz"], str)


def test_calls_follow_their_schemas_through_preemption(runner: ModelRunner) -> None:
    prompts, params, uses = _requests(runner)
    alone = drive(runner, prompts, params, num_blocks=100, block_size=16, max_model_len=384)
    messages = {}
    for name, use in uses.items():
        parser = ToolCallParser(use)
        parser.feed(alone.text[name])
        finish = parser.finish(alone.finish[name])[2]
        messages[name] = (parser.message(), finish)
    message, finish = messages["required"]
    (call,) = message["tool_calls"]  # parallel_tool_calls false: one call, then EOS
    assert finish == "tool_calls" and message["content"] is None
    assert _valid(call["function"]["name"], json.loads(call["function"]["arguments"]))
    message, finish = messages["named"]
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_time" and finish == "stop"
    assert _valid("get_time", json.loads(call["function"]["arguments"]))
    message, finish = messages["many"]
    # Parallel calls until `max_tokens`: a call it cuts short stays content.
    assert message["tool_calls"] and (message["content"] is None
                                      or message["content"].startswith("<tool_call>"))
    for call in message["tool_calls"]:
        assert _valid(call["function"]["name"], json.loads(call["function"]["arguments"]))
    # `auto` leaves the model free: this one answers in words.
    message, finish = messages["auto"]
    assert "tool_calls" not in message and message["content"] == alone.text["auto"]
    tight = drive(runner, prompts, params, num_blocks=24, block_size=16, max_model_len=384,
                  max_batch_tokens=128)
    assert tight.num_mid_generation_preemptions > 0
    assert tight.tokens == alone.tokens


def test_llama3_json_calls_are_written_and_read_back(runner: ModelRunner) -> None:
    """Llama 3's format: the prompt teaches it (SmolLM2's template renders no
    tools), the grammar holds the model to it, the parser reads it back."""
    prompts, params, uses = _requests(runner, LLAMA3_JSON)
    out = drive(runner, prompts, params, num_blocks=100, block_size=16, max_model_len=384)
    assert out.text["required"].startswith('{"name": "')
    messages = {}
    for name in ("required", "many"):
        parser = ToolCallParser(uses[name])
        parser.feed(out.text[name])
        messages[name] = (parser.finish(out.finish[name])[2], parser.message())
    finish, message = messages["required"]
    (call,) = message["tool_calls"]  # parallel_tool_calls false: one call, then EOS
    assert finish == "tool_calls" and message["content"] is None
    assert _valid(call["function"]["name"], json.loads(call["function"]["arguments"]))
    finish, message = messages["many"]
    assert message["tool_calls"], out.text["many"]
    for call in message["tool_calls"]:
        assert _valid(call["function"]["name"], json.loads(call["function"]["arguments"]))
