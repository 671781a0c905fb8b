"""OpenAI's Predicted Outputs (`prediction` on chat): the prediction's
tokens reach the engine as drafts for speculative decoding, the usage
counts its accepted and refused tokens, and requests whose drafts could
not be verified are refused naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.api.harness import Harness, harness

CODE = "def add(a, b):\n    return a + b\n"
MSGS = [{"role": "user", "content": "Rename add to plus:\n" + CODE}]


@pytest.fixture(scope="module")
def h() -> Iterator[Harness]:
    with harness(max_model_len=1024, speculative={"num_tokens": 4}) as h:
        yield h


def _chat(h: Harness, **body: Any) -> Any:
    return h.client.post("/v1/chat/completions", json={
        "model": h.model_name, "max_tokens": 8, "temperature": 0, "messages": MSGS, **body})


@pytest.mark.parametrize("content", [CODE, [{"type": "text", "text": "def add(a, b):\n"},
                                            {"type": "text", "text": "    return a + b\n"}]])
def test_the_prediction_reaches_the_engine_and_the_usage_counts_it(
        h: Harness, content: Any) -> None:
    r = _chat(h, prediction={"type": "content", "content": content}, n=2)
    assert r.status_code == 200, r.text
    req = h.engine.requests[-1]
    tok = h.engine.state.tokenizer
    assert req.prediction_token_ids == tok(CODE, add_special_tokens=False)["input_ids"]
    usage = r.json()["usage"]
    per_choice = usage["completion_tokens"] // 2
    assert usage["completion_tokens_details"] == {
        "accepted_prediction_tokens": 2 * (per_choice - 1), "rejected_prediction_tokens": 2}
    plain = _chat(h).json()["usage"]
    assert h.engine.requests[-1].prediction_token_ids is None
    assert "completion_tokens_details" not in plain


@pytest.mark.parametrize("extra", [
    {"logprobs": True}, {"response_format": {"type": "json_object"}},
    {"tools": [{"type": "function", "function": {"name": "f"}}]},
])
def test_requests_whose_drafts_cannot_be_verified_are_refused(
        h: Harness, extra: dict[str, Any]) -> None:
    r = _chat(h, prediction={"type": "content", "content": CODE}, **extra)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prediction", r.text
    assert "logprobs, structured output or tools" in r.json()["error"]["message"]


@pytest.mark.parametrize("extra", [
    {"temperature": 1.0}, {"temperature": 0.7, "seed": 3, "top_p": 0.9},
    {"presence_penalty": 0.5}, {"logit_bias": {"5": 1.0}}, {"min_tokens": 2},
])
def test_sampled_and_penalised_requests_take_a_prediction(h: Harness,
                                                          extra: dict[str, Any]) -> None:
    r = _chat(h, prediction={"type": "content", "content": CODE}, **extra)
    assert r.status_code == 200, r.text
    assert h.engine.requests[-1].prediction_token_ids


def test_without_speculative_decoding_a_prediction_is_refused(served: Harness) -> None:
    r = served.client.post("/v1/chat/completions", json={
        "model": served.model_name, "max_tokens": 4, "temperature": 0, "messages": MSGS,
        "prediction": {"type": "content", "content": CODE}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prediction"
    assert "speculative.num_tokens" in r.json()["error"]["message"]
    r = served.client.post("/v1/completions", json={
        "model": served.model_name, "prompt": "x",
        "prediction": {"type": "content", "content": CODE}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prediction"
