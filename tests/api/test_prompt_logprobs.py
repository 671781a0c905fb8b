"""vLLM's `prompt_logprobs` through the completions route: the engine's
prompt logprobs reach the client, one entry per prompt token."""

from __future__ import annotations

from tests.api.harness import Harness


def test_prompt_logprobs_reach_the_client(served: Harness) -> None:
    r = served.client.post("/v1/completions", json={
        "model": served.model_name, "prompt": "The quick brown fox", "max_tokens": 2,
        "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    plps = r.json()["choices"][0]["prompt_logprobs"]
    prompt = served.engine.requests[-1].prompt_token_ids
    assert len(plps) == len(prompt) > 1 and plps[0] is None
    assert all(str(t) in at and len(at) <= 3 for t, at in zip(prompt[1:], plps[1:]))
