"""vLLM's `truncate_prompt_tokens`: only the prompt's last tokens reach the
engine, and the response counts (and echoes) those."""

from __future__ import annotations

from tests.api.conftest import MAX_MODEL_LEN
from tests.api.harness import Harness


def _complete(h: Harness, **extra: object) -> dict:
    r = h.client.post("/v1/completions", json={"model": h.model_name, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_only_the_last_tokens_reach_the_engine(served: Harness) -> None:
    prompt = "one two three four five six seven eight nine ten"
    body = _complete(served, prompt=prompt, max_tokens=2)
    full = served.engine.requests[-1].prompt_token_ids
    assert len(full) > 4
    body = _complete(served, prompt=prompt, max_tokens=2, truncate_prompt_tokens=4, echo=True)
    assert served.engine.requests[-1].prompt_token_ids == full[-4:]
    assert body["usage"]["prompt_tokens"] == 4
    assert body["choices"][0]["text"].startswith(served.ingress.tokenizer.decode(full[-4:]))
    # A prompt no longer than k is left whole.
    _complete(served, prompt=prompt, max_tokens=2, truncate_prompt_tokens=len(full) + 5)
    assert served.engine.requests[-1].prompt_token_ids == full


def test_minus_one_keeps_what_fits_beside_max_tokens(served: Harness) -> None:
    ids = list(range(10, 10 + MAX_MODEL_LEN + 40))  # longer than the context
    r = served.client.post("/v1/completions", json={
        "model": served.model_name, "prompt": ids, "max_tokens": 16})
    assert r.status_code == 400  # without truncation it does not fit
    _complete(served, prompt=ids, max_tokens=16, truncate_prompt_tokens=-1)
    assert served.engine.requests[-1].prompt_token_ids == ids[-(MAX_MODEL_LEN - 16):]


def test_zero_is_refused_by_name(served: Harness) -> None:
    r = served.client.post("/v1/chat/completions", json={
        "model": served.model_name, "messages": [{"role": "user", "content": "hi"}],
        "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
