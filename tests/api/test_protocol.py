"""The OpenAI request surface: every field is served in OpenAI's documented
range, or refused by name; nothing a client sends is dropped unread."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from api.errors import validation_error
from api.protocol import ChatCompletionRequest, CompletionRequest
from api.unsupported import UNSUPPORTED_FIELDS

MSG = [{"role": "user", "content": "hi"}]


def refusal(model: type, body: dict[str, Any]) -> tuple[str | None, str]:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    err = validation_error(e.value)
    assert err.status == 400
    return err.param, err.message


@pytest.mark.parametrize(("field", "bad", "good"), [
    ("presence_penalty", 2.5, -2.0),
    ("frequency_penalty", -2.01, 2.0),
    ("repetition_penalty", 0.0, 1.3),
    ("temperature", 2.1, 0.0),
    ("top_p", 0.0, 1.0),
    ("n", 0, 128),
    ("n", 129, 1),
    ("logprobs", 6, 5),          # OpenAI: at most 5 for completions
    ("logprobs", -1, 0),
    ("max_tokens", 0, 1),
    ("seed", 2**63, -(2**63)),
    ("top_k", 2**40, 50),
    ("priority", 2**40, -5),
    ("prompt_logprobs", 21, 20),
    ("best_of", 3, 2),           # with n = 2 below: only best_of == n
])
def test_completion_ranges(field: str, bad: Any, good: Any) -> None:
    base = {"prompt": "hi", "n": 2} if field == "best_of" else {"prompt": "hi"}
    param, _ = refusal(CompletionRequest, {**base, field: bad})
    assert param == field
    assert getattr(CompletionRequest.model_validate({**base, field: good}), field) == good


@pytest.mark.parametrize(("field", "bad", "good"), [
    ("top_logprobs", 21, 20),
    ("max_completion_tokens", 0, 7),
])
def test_chat_ranges(field: str, bad: Any, good: Any) -> None:
    base = {"messages": MSG, "logprobs": True}
    param, _ = refusal(ChatCompletionRequest, {**base, field: bad})
    assert param == field
    assert getattr(ChatCompletionRequest.model_validate({**base, field: good}), field) == good


def test_logit_bias_keys_are_token_ids_and_values_in_range() -> None:
    assert refusal(CompletionRequest, {"prompt": "x", "logit_bias": {"50": 101}})[0] == "logit_bias"
    assert refusal(CompletionRequest, {"prompt": "x", "logit_bias": {"a": 1}})[0] == "logit_bias"
    assert refusal(CompletionRequest, {"prompt": "x", "logit_bias": {"-3": 1}})[0] == "logit_bias"
    ok = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"50": -100, "7": 3}})
    assert ok.bias_by_id() == {50: -100.0, 7: 3.0}


def test_dependent_fields_are_refused_at_the_field_that_needs_the_other() -> None:
    assert refusal(ChatCompletionRequest, {"messages": MSG, "top_logprobs": 2})[0] == "top_logprobs"
    assert refusal(CompletionRequest, {"prompt": "x", "stream_options": {
        "include_usage": True}})[0] == "stream_options"
    assert refusal(ChatCompletionRequest, {"messages": MSG, "max_tokens": 3,
                                           "max_completion_tokens": 4})[0] == "max_completion_tokens"
    assert refusal(CompletionRequest, {"prompt": "x", "suffix": "end"})[0] == "suffix"
    assert refusal(ChatCompletionRequest, {"messages": MSG, "echo": True})[0] == "echo"
    # vLLM's rule: prompt logprobs come with the whole response only.
    for model, body in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": MSG})):
        param, msg = refusal(model, {**body, "stream": True, "prompt_logprobs": 1})
        assert param == "prompt_logprobs" and "stream" in msg
        assert model.model_validate({**body, "prompt_logprobs": 1}).prompt_logprobs == 1


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_FIELDS))
def test_unsupported_fields_pass_when_off_and_are_named_when_on(field: str) -> None:
    on: Any = {"functions": [{"name": "f"}], "function_call": "auto",
               "modalities": ["audio"], "store": True, "service_tier": "priority",
               "spaces_between_special_tokens": False,
               "add_generation_prompt": False, "length_penalty": 2.0,
               "chat_template_kwargs": {"x": 1}}.get(field, "on")
    # Chat serves `store` and `metadata` (api/chat_store_route.py): legacy
    # completions still refuse them.
    model, body = ((CompletionRequest, {"prompt": "x"}) if field in ChatCompletionRequest.served
                   else (ChatCompletionRequest, {"messages": MSG}))
    param, msg = refusal(model, {**body, field: on})
    assert param == field and "not supported" in msg
    assert model.model_validate({**body, field: None})


def test_what_openai_does_by_default_and_this_server_does_not_is_named() -> None:
    # Each is accepted with the value that asks for what this server does.
    for retention in ("in_memory", "in-memory"):  # the SDKs' newer and older spelling
        ChatCompletionRequest.model_validate({"messages": MSG, "prompt_cache_retention": retention})
    param, msg = refusal(ChatCompletionRequest, {"messages": MSG, "prompt_cache_retention": "24h"})
    assert param == "prompt_cache_retention" and "in memory only" in msg
    for implicit in ({}, {"mode": "implicit"}):  # caching by prefix, automatic
        ChatCompletionRequest.model_validate({"messages": MSG, "prompt_cache_options": implicit})
    param, msg = refusal(ChatCompletionRequest, {"messages": MSG,
                                                 "prompt_cache_options": {"ttl": "24h"}})
    assert param == "prompt_cache_options" and "no breakpoints or ttl" in msg
    streamed = {"messages": MSG, "stream": True}
    req = ChatCompletionRequest.model_validate(
        {**streamed, "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert req.stream_options is not None and req.stream_options.include_usage
    param, msg = refusal(ChatCompletionRequest,
                         {**streamed, "stream_options": {"include_obfuscation": True}})
    assert param == "stream_options.include_obfuscation" and "not obfuscated" in msg


def test_unknown_fields_are_refused_by_name() -> None:
    param, msg = refusal(CompletionRequest, {"prompt": "x", "max_token": 5})
    assert param == "max_token"


def test_chat_messages_take_text_only_and_tool_roles_with_their_ids() -> None:
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    param, msg = refusal(ChatCompletionRequest, {"messages": [{"role": "user", "content": image}]})
    assert param is not None and param.startswith("messages.0.content") and "image_url" in msg
    param, msg = refusal(ChatCompletionRequest, {"messages": [{"role": "tool", "content": "x"}]})
    assert param is not None and param.startswith("messages.0") and "tool_call_id" in msg
    param, msg = refusal(ChatCompletionRequest, {"messages": [{"role": "function", "content": "x",
                                                               "name": "f"}]})
    assert param == "messages.0" and "deprecated" in msg
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for bad in ({"role": "user", "content": "x", "tool_calls": [call]},  # calls are answers
                {"role": "user", "content": None},  # only an answer with calls has none
                {"role": "user", "content": "x", "tool_call_id": "c"}):
        assert refusal(ChatCompletionRequest, {"messages": [bad]})[0] == "messages.0"
    ok = ChatCompletionRequest.model_validate({"messages": [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c"}]})
    assert ok.messages[0].text() == "" and ok.messages[1].tool_call_id == "c"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": parts, "name": "ann"}]})
    assert req.messages[0].template_dict() == {"role": "user", "content": "ab", "name": "ann"}


def test_prompt_batches() -> None:
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert CompletionRequest.model_validate({"prompt": [[1, 2], [3]]}).prompts() == [[1, 2], [3]]
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompts() == [[1, 2]]
    assert refusal(CompletionRequest, {"prompt": []})[0] == "prompt"
    assert refusal(CompletionRequest, {"prompt": ["a", ""]})[0] == "prompt"
