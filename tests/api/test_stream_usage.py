"""`stream_options`: the usage chunk at the end, and with vLLM's
`continuous_usage_stats` the usage so far on every chunk."""

from __future__ import annotations

import json

import pytest

from tests.api.harness import Harness


def _events(h: Harness, options: dict[str, bool]) -> list[dict]:
    r = h.client.post("/v1/completions", json={
        "model": h.model_name, "prompt": "a b c", "max_tokens": 4, "n": 2, "stream": True,
        "stream_options": options})
    assert r.status_code == 200, r.text
    raw = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert raw[-1] == "[DONE]"
    return [json.loads(e) for e in raw[:-1]]


def test_every_chunk_carries_the_usage_so_far(served: Harness) -> None:
    events = _events(served, {"include_usage": True, "continuous_usage_stats": True})
    assert all("usage" in e for e in events)
    completion = [e["usage"]["completion_tokens"] for e in events]
    assert completion == sorted(completion) and completion[-1] > completion[0]
    prompt = {e["usage"]["prompt_tokens"] for e in events}
    assert len(prompt) == 1 and prompt.pop() > 0
    # The last chunk's usage is the final usage chunk's.
    assert events[-1]["choices"] == [] and events[-2]["usage"] == events[-1]["usage"]


@pytest.mark.parametrize("options", [{"include_usage": True}, {"continuous_usage_stats": True},
                                     {}])
def test_otherwise_only_the_final_chunk_does(served: Harness, options: dict[str, bool]) -> None:
    events = _events(served, options)
    with_usage = [e for e in events if "usage" in e]
    assert len(with_usage) == (1 if options.get("include_usage") else 0)
    assert all(e["choices"] == [] for e in with_usage)


def test_vllm_output_flags_reach_the_engine(served: Harness) -> None:
    r = served.client.post("/v1/completions", json={
        "model": served.model_name, "prompt": "x", "max_tokens": 2, "stop": ["."],
        "include_stop_str_in_output": True, "skip_special_tokens": False})
    assert r.status_code == 200, r.text
    req = served.engine.requests[-1]
    assert req.include_stop_str_in_output and not req.skip_special_tokens
    r = served.client.post("/v1/completions", json={
        "model": served.model_name, "prompt": "x", "max_tokens": 2})
    req = served.engine.requests[-1]
    assert not req.include_stop_str_in_output and req.skip_special_tokens
