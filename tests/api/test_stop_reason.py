"""vLLM's `stop_reason` beside `finish_reason`: the stop string (or stop
token id) that ended a choice, None where EOS or the length ended it."""

from __future__ import annotations

import json

from tests.api.harness import Harness


def test_chat_and_completions_name_the_stop_string_streamed_or_not(wide: Harness) -> None:
    h = wide
    h.engine.state.answer = "one, two, STOP three"
    chat = {"model": h.model_name, "max_tokens": 32, "stop": [" STOP"],
            "messages": [{"role": "user", "content": "Count"}]}
    choice = h.client.post("/v1/chat/completions", json=chat).json()["choices"][0]
    assert choice["message"]["content"] == "one, two,"
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", " STOP")
    r = h.client.post("/v1/chat/completions", json={**chat, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    last = chunks[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", " STOP")
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) \
        == "one, two,"
    text = h.client.post("/v1/completions", json={
        "model": h.model_name, "prompt": "Count", "max_tokens": 32, "stop": " STOP",
        "include_stop_str_in_output": True}).json()["choices"][0]
    assert text["text"] == "one, two, STOP" and text["stop_reason"] == " STOP"
    plain = h.client.post("/v1/chat/completions", json={**chat, "stop": None}).json()
    assert plain["choices"][0]["stop_reason"] is None
    assert plain["choices"][0]["message"]["content"] == "one, two, STOP three"
