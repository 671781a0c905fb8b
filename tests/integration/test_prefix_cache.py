"""Prefix caching through the served application: a request that begins
like an earlier one reports the prompt tokens it found cached in its usage,
and with two engine replicas, requests sharing a system prompt go to the
replica that holds it (scheduler/prefix_affinity.py), and so do requests
that share a `prompt_cache_key`."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integration.conftest import SMALL_CONFIG, _deploy

pytestmark = pytest.mark.integration

SYSTEM = ("You are a patient assistant for a bakery. Answer questions about bread, "
          "flour, ovens and opening hours in two sentences at most. ") * 4


def _ask(base: str, question: str) -> dict:
    r = httpx.post(f"{base}/v1/completions", json={
        "prompt": SYSTEM + question, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _cacheable(a: str, b: str, block: int = 16) -> int:
    """Tokens of `b`'s prompt whose KV `a`'s leaves in the cache: the full
    blocks of their common beginning."""
    from itertools import takewhile

    from transformers import AutoTokenizer

    from engine.model_source import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("embedded:smollm2"))
    x, y = tok(a)["input_ids"], tok(b)["input_ids"]
    common = sum(1 for _ in takewhile(lambda t: t[0] == t[1], zip(x, y)))
    return min(common, len(y) - 1) // block * block


def test_a_repeated_system_prompt_is_reported_cached(server):
    first = _ask(server, "When do you open?")
    again = _ask(server, "Do you sell rye bread?")
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    expected = _cacheable(SYSTEM + "When do you open?", SYSTEM + "Do you sell rye bread?")
    assert expected >= 80 and cached == expected, again["usage"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < cached
    assert again["metrics"]["cached_tokens"] == cached


# In the long run (-m slow): two engine replicas of their own, forty seconds
# of a default run that must stay short.  The default run keeps the cache
# live (the test above); the routing is tests/scheduler/test_prefix_affinity.py's.
@pytest.mark.slow
def test_requests_sharing_a_prefix_go_to_the_replica_that_holds_it(server):
    from ray import serve

    base = _deploy(server, "prefix2", {**SMALL_CONFIG, "num_engine_replicas": 2,
                                       "engine_num_cpus": 0.25, "num_threads": 1,
                                       "admission": {"enabled": False}})
    try:
        _ask(base, "When do you open?")
        for question in ("Is the oven hot?", "Do you bake on Sundays?", "Any spelt flour?"):
            time.sleep(1.0)  # both replicas report themselves idle again
            usage = _ask(base, question)["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 80, usage
        sched = serve.get_deployment_handle("Scheduler", app_name="prefix2")
        assert sched.stats.remote().result()["prefix_placements"] == 3
        engines = serve.get_deployment_handle("Engine", app_name="prefix2")
        hits = []
        for _ in range(20):  # one call reaches one replica: ask until both answered
            s = engines.stats.remote().result()
            hits.append((s["replica"], s["prefix_cache"]["hit_tokens"]))
            if len(dict(hits)) == 2:
                break
        by_replica = dict(hits)
        assert len(by_replica) == 2, hits
        assert sorted(v > 0 for v in by_replica.values()) == [False, True], by_replica
        # Prompts sharing nothing, one client key: the 2nd and 3rd follow the 1st.
        for i, topic in enumerate(("rye", "yeast", "croissants")):
            time.sleep(1.0)
            r = httpx.post(f"{base}/v1/completions", json={
                "prompt": f"Tell me about {topic}. " * (8 + i), "max_tokens": 2,
                "prompt_cache_key": "conversation-9"}, timeout=120)
            assert r.status_code == 200, r.text
        assert sched.stats.remote().result()["prefix_placements"] == 5
    finally:
        serve.delete("prefix2")
