"""vLLM's `return_token_ids` (the prompt's and each choice's token ids
beside the text, whole and streamed) and `return_tokens_as_token_ids`
(logprobs name tokens "token_id:<id>")."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.api.harness import Harness

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _post(h: Harness, path: str, **body: Any) -> Any:
    r = h.client.post(path, json={"model": h.model_name, "max_tokens": 8, **body})
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()
    raw = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert raw[-1] == "[DONE]"
    return [json.loads(e) for e in raw[:-1]]


def _decode(h: Harness, ids: list[int]) -> str:
    return str(h.engine.state.tokenizer.decode(ids))


def test_a_chat_answer_carries_its_prompts_and_its_ids(wide: Harness) -> None:
    wide.engine.state.answer = "Blue, like the sea."
    msgs = [{"role": "user", "content": "A colour?"}]
    out = _post(wide, "/v1/chat/completions", messages=msgs, n=2, return_token_ids=True)
    assert out["prompt_token_ids"] == wide.engine.requests[-1].prompt_token_ids
    for c in out["choices"]:
        assert _decode(wide, c["token_ids"]) == c["message"]["content"] == "Blue, like the sea."
        assert len(c["token_ids"]) * 2 == out["usage"]["completion_tokens"]
    # Streamed: the prompt's ids on the first chunk, each chunk's new ids.
    events = _post(wide, "/v1/chat/completions", messages=msgs, return_token_ids=True,
                   stream=True)
    assert events[0]["prompt_token_ids"] == out["prompt_token_ids"]
    assert all("prompt_token_ids" not in e for e in events[1:])
    ids = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert ids == out["choices"][0]["token_ids"]
    # Not asked: nothing added.
    plain = _post(wide, "/v1/chat/completions", messages=msgs)
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_completions_carry_them_per_choice(served: Harness) -> None:
    out = _post(served, "/v1/completions", prompt=["a b c", "d e"], n=2, max_tokens=4,
                return_token_ids=True, echo=True)
    sent = [r.prompt_token_ids for r in served.engine.requests[-2:]]
    for c in out["choices"]:
        assert c["prompt_token_ids"] == sent[c["index"] // 2]
        # The generated ids only; echo adds the prompt's text, not its ids.
        assert c["text"] == ["a b c", "d e"][c["index"] // 2] + _decode(served, c["token_ids"])
    events = _post(served, "/v1/completions", prompt="a b c", n=2, max_tokens=4,
                   return_token_ids=True, stream=True)
    for index in (0, 1):
        mine = [c for e in events for c in e["choices"] if c["index"] == index]
        assert mine[0]["prompt_token_ids"] == served.engine.requests[-1].prompt_token_ids
        assert all("prompt_token_ids" not in c for c in mine[1:])
        ids = [t for c in mine for t in c["token_ids"]]
        assert ids == out["choices"][index]["token_ids"]
        assert _decode(served, ids) == "".join(c["text"] for c in mine)


def test_a_streamed_tool_call_holds_no_ids_back(wide: Harness) -> None:
    """The parser holds a call's text back until it is whole; its ids still
    go out as they come, and the stream's ids are the answer's."""
    wide.engine.state.answer = CALL
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    whole = _post(wide, "/v1/chat/completions", messages=msgs, tools=[WEATHER],
                  max_tokens=64, return_token_ids=True)
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert _decode(wide, whole["choices"][0]["token_ids"]) == CALL
    events = _post(wide, "/v1/chat/completions", messages=msgs, tools=[WEATHER],
                   max_tokens=64, return_token_ids=True, stream=True)
    with_ids = [c for e in events for c in e["choices"] if c.get("token_ids")]
    assert len(with_ids) == len(whole["choices"][0]["token_ids"])
    assert [t for c in with_ids for t in c["token_ids"]] == whole["choices"][0]["token_ids"]


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_name_tokens_by_id(served: Harness, stream: bool) -> None:
    out = _post(served, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}],
                logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True,
                return_token_ids=True, stream=stream)
    chunks = out if stream else [out]
    ids = [t for e in chunks for c in e["choices"] for t in c.get("token_ids", [])]
    entries = [x for e in chunks for c in e["choices"] if c["logprobs"]
               for x in c["logprobs"]["content"]]
    tok = served.engine.state.tokenizer
    assert [x["token"] for x in entries] == [f"token_id:{t}" for t in ids]
    # The bytes stay the token's own.
    assert [bytes(x["bytes"]) for x in entries] == [tok.decode([t]).encode() for t in ids]
    assert all(a["token"].startswith("token_id:") for x in entries for a in x["top_logprobs"])


def test_completion_logprobs_name_tokens_by_id_with_text_offsets(served: Harness) -> None:
    named = _post(served, "/v1/completions", prompt="a b c", max_tokens=4, logprobs=2,
                  return_tokens_as_token_ids=True, return_token_ids=True)["choices"][0]
    plain = _post(served, "/v1/completions", prompt="a b c", max_tokens=4,
                  logprobs=2)["choices"][0]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in named["token_ids"]]
    assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert all(k.startswith("token_id:") for top in named["logprobs"]["top_logprobs"]
               for k in top)
