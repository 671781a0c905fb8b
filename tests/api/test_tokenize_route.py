"""`/tokenize` counts what the completion routes would send the engine,
`/detokenize` turns ids back into text, and bad bodies are 4xx naming the
field."""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.harness import Harness

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _tokenize(h: Harness, **body: Any) -> Any:
    return h.client.post("/tokenize", json={"model": h.model_name, **body})


def test_a_prompt_counts_as_completions_sends_it(served: Harness) -> None:
    r = _tokenize(served, prompt="Hello there", return_token_strs=True)
    assert r.status_code == 200, r.text
    out = r.json()
    assert served.client.post("/v1/completions", json={
        "model": served.model_name, "prompt": "Hello there", "max_tokens": 2}).status_code == 200
    assert out["tokens"] == served.engine.requests[-1].prompt_token_ids
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 256
    assert "".join(out["token_strs"]).replace("Ġ", " ") == "Hello there"
    bare = _tokenize(served, prompt="Hello there", add_special_tokens=False).json()
    assert "token_strs" not in bare and bare["tokens"] == out["tokens"]  # SmolLM2 adds no BOS


@pytest.mark.parametrize("extra", [{}, {"tools": [WEATHER]},
                                   {"tools": [WEATHER], "tool_choice": "none"}])
def test_messages_count_as_chat_sends_them(served: Harness, extra: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    r = _tokenize(served, messages=messages, **extra)
    assert r.status_code == 200, r.text
    assert served.client.post("/v1/chat/completions", json={
        "model": served.model_name, "messages": messages, "max_tokens": 2,
        **extra}).status_code == 200
    assert r.json()["tokens"] == served.engine.requests[-1].prompt_token_ids
    # Without the assistant's opening: the conversation alone.
    bare = _tokenize(served, messages=messages, add_generation_prompt=False, **extra).json()
    whole = r.json()
    assert bare["tokens"] == whole["tokens"][:bare["count"]] and bare["count"] < whole["count"]


def test_detokenize_returns_the_text(served: Harness) -> None:
    ids = _tokenize(served, prompt="a cat on a mat").json()["tokens"]
    r = served.client.post("/detokenize", json={"model": served.model_name, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "a cat on a mat"}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400,
     "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     400, "tool_choice"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
])
def test_bad_bodies_are_named(served: Harness, path: str, body: dict[str, Any], status: int,
                              param: str) -> None:
    r = served.client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
