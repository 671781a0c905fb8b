"""A replica's death mid-generation loses no request: two engine replicas,
16 streams, one replica killed (`ray.kill` on its actor) while they run;
every stream ends normally with the text an undisturbed run gives
(deployments/resume.py; float32, greedy)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.integration.conftest import PROMPTS, SMALL_CONFIG, _deploy

pytestmark = pytest.mark.integration

TWO_CONFIG = {
    **SMALL_CONFIG,
    "num_engine_replicas": 2,
    "engine_num_cpus": 0.25,
    "num_threads": 1,
    # All 16 at once: none refused.
    "admission": {"enabled": False},
}
N = 48


def body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "stream": True}


async def _stream(c: httpx.AsyncClient, url: str, prompt: str, started: asyncio.Event,
                  counts: list[int], i: int) -> tuple[str, list[str]]:
    text, events = "", []
    async with c.stream("POST", url, json=body(prompt)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if line[6:] == "[DONE]":
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            counts[i] += 1
            if min(counts) >= 4:
                started.set()
    return text, events


def _engine_actors(app: str) -> list[str]:
    from ray.util import list_named_actors

    return [a["name"] for a in list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and f"SERVE_REPLICA::{app}#Engine#" in a["name"]]


def test_streams_survive_the_death_of_their_replica(server):
    import ray
    from ray import serve

    base = _deploy(server, "two", TWO_CONFIG)
    try:
        engines = _engine_actors("two")
        assert len(engines) == 2, engines
        prompts = (PROMPTS * 2)[:16]

        async def run() -> list[tuple[str, list[str]]]:
            started = asyncio.Event()
            counts = [0] * len(prompts)
            async with httpx.AsyncClient(timeout=300) as c:
                tasks = [asyncio.create_task(_stream(c, f"{base}/v1/completions", p, started,
                                                     counts, i))
                         for i, p in enumerate(prompts)]
                await asyncio.wait_for(started.wait(), 120)
                # Every stream has tokens; none has all of them yet.
                assert max(counts) < N
                ray.kill(ray.get_actor(engines[0], namespace="serve"), no_restart=False)
                return await asyncio.gather(*tasks)

        got = asyncio.run(run())
        stats = serve.get_deployment_handle("Scheduler", app_name="two").stats.remote().result()
        assert stats["resumed"] > 0, stats
        for p, (text, events) in zip(prompts, got):
            assert events[-1] == "[DONE]"
            ref = httpx.post(f"{server}/v1/completions",
                             json={**body(p), "stream": False}, timeout=300).json()
            assert text == ref["choices"][0]["text"], p
    finally:
        serve.delete("two")
