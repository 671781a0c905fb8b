"""The Scheduler replica failing under a waiting `admit` call (an offline
request in its pool when it dies or restarts) is a 503 to retry, and the
request's priority reaches the Scheduler (the offline pool orders by it), as
do its prompt's block keys (placement by cached prefix), and the engine
request carries the id it was admitted under."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from tests.api.harness import Harness


@pytest.fixture
def dead_scheduler(served: Harness) -> Iterator[Harness]:
    real = served.scheduler.admit

    class Dead:
        def remote(self, *args: Any, **kwargs: Any) -> Any:
            async def fail() -> Any:
                raise ActorDiedError()

            return fail()

    served.scheduler.admit = Dead()  # type: ignore[assignment]
    try:
        yield served
    finally:
        served.scheduler.admit = real


@pytest.mark.parametrize("stream", [False, True])
def test_a_scheduler_that_died_is_a_503(dead_scheduler: Harness, stream: bool) -> None:
    sent = len(dead_scheduler.engine.requests)  # the harness is shared
    r = dead_scheduler.client.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": 2, "job_class": "offline", "stream": stream})
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and "retry" in err["message"]
    assert len(dead_scheduler.engine.requests) == sent  # nothing reached an engine


def test_priority_reaches_the_scheduler(served: Harness) -> None:
    seen: list[dict[str, Any]] = []
    real = served.scheduler.admit

    class Spy:
        def remote(self, *args: Any, **kwargs: Any) -> Any:
            seen.append(kwargs)
            return real.remote(*args, **kwargs)

    served.scheduler.admit = Spy()  # type: ignore[assignment]
    try:
        r = served.client.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 2, "job_class": "offline", "priority": -3})
    finally:
        served.scheduler.admit = real
    assert r.status_code == 200, r.text
    assert seen == [{"priority": -3}]


def test_a_long_prompts_block_keys_reach_the_scheduler(served: Harness) -> None:
    from scheduler.prefix_affinity import prefix_keys

    prompt = "You are a careful assistant. " * 12
    r = served.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    request_id = served.scheduler.admitted[-1][0]
    tokens = served.ingress.tokenizer(prompt)["input_ids"]
    block = served.ingress.cfg.block_size
    keys = served.scheduler.prefix_keys[request_id]
    assert keys == prefix_keys(tokens, block) and len(keys) == (len(tokens) - 1) // block


def test_a_prompt_cache_key_reaches_the_scheduler_as_a_routing_key(served: Harness) -> None:
    """OpenAI's `prompt_cache_key` routes (scheduler/placement.py); it does
    not salt the prefix keys, which requests without it share."""
    from scheduler.prefix_affinity import prefix_keys, route_key

    prompt = "You are a careful assistant. " * 12
    r = served.client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 2, "prompt_cache_key": "thread-42"})
    assert r.status_code == 200, r.text
    request_id = served.scheduler.admitted[-1][0]
    tokens = served.ingress.tokenizer(prompt)["input_ids"]
    assert served.scheduler.prefix_keys[request_id] == prefix_keys(
        tokens, served.ingress.cfg.block_size)
    assert served.scheduler.route_keys[request_id] == route_key("thread-42")
    assert served.engine.requests[-1].cache_salt is None
    r = served.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert served.scheduler.route_keys[served.scheduler.admitted[-1][0]] is None
    bad = served.client.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": 2, "prompt_cache_key": ""})
    assert bad.status_code == 400 and "prompt_cache_key" in bad.text


def test_a_cache_salt_reaches_the_engine_and_salts_the_keys(served: Harness) -> None:
    from scheduler.prefix_affinity import prefix_keys

    prompt = "You are a careful assistant. " * 12
    r = served.client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 2, "cache_salt": "tenant-7"})
    assert r.status_code == 200, r.text
    assert served.engine.requests[-1].cache_salt == "tenant-7"
    request_id = served.scheduler.admitted[-1][0]
    tokens = served.ingress.tokenizer(prompt)["input_ids"]
    assert served.scheduler.prefix_keys[request_id] == prefix_keys(
        tokens, served.ingress.cfg.block_size, "tenant-7")
    bad = served.client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 2, "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt", bad.text


def test_each_prompt_reaches_the_engine_under_the_admitted_id(served: Harness) -> None:
    """The replica reports a request taken in under the id the Scheduler
    admitted it by (scheduler/placement.py), whatever its prompts' ids."""
    sent = len(served.engine.requests)
    r = served.client.post("/v1/completions", json={
        "model": served.model_name, "prompt": ["one", "two"], "max_tokens": 2})
    assert r.status_code == 200, r.text
    admitted = served.scheduler.admitted[-1][0]
    gens = served.engine.requests[sent:]
    assert len({g.request_id for g in gens}) == 2
    assert [g.admission_id for g in gens] == [admitted, admitted]

