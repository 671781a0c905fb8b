"""`service_tier: "flex"` (OpenAI's tier for work that can wait) is offline
work: on chat, completions and Responses it is admitted as `job_class:
offline`, which co-serving runs in the capacity online work leaves."""

from __future__ import annotations

from typing import Any

import pytest

from api.protocol import ChatCompletionRequest, CompletionRequest
from tests.api.harness import Harness

MSG = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("model, body", [(ChatCompletionRequest, {"messages": MSG}),
                                         (CompletionRequest, {"prompt": "Hi"})])
def test_flex_is_offline_work(model: Any, body: dict[str, Any]) -> None:
    assert model.model_validate({**body, "service_tier": "flex"}).job_class == "offline"
    assert model.model_validate({**body, "service_tier": "flex",
                                 "job_class": "offline"}).job_class == "offline"
    for tier in (None, "auto", "default"):
        assert model.model_validate({**body, "service_tier": tier}).job_class == "online"
    with pytest.raises(ValueError, match="job_class"):
        model.model_validate({**body, "service_tier": "flex", "job_class": "online"})


def test_a_flex_request_is_admitted_as_offline(served: Harness) -> None:
    r = served.client.post("/v1/chat/completions", json={
        "model": served.model_name, "messages": MSG, "max_tokens": 4, "service_tier": "flex"})
    assert r.status_code == 200, r.text
    assert served.scheduler.admitted[-1][3] == "offline"
    bad = served.client.post("/v1/chat/completions", json={
        "model": served.model_name, "messages": MSG, "max_tokens": 4, "service_tier": "flex",
        "job_class": "online"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "job_class"
    r = served.client.post("/v1/responses", json={
        "model": served.model_name, "input": "Hi", "max_output_tokens": 4,
        "service_tier": "flex"})
    assert r.status_code == 200, r.text
    assert r.json()["service_tier"] == "flex" and served.scheduler.admitted[-1][3] == "offline"
    r = served.client.post("/v1/responses", json={
        "model": served.model_name, "input": "Hi", "max_output_tokens": 4})
    assert r.json()["service_tier"] == "default" and served.scheduler.admitted[-1][3] == "online"
