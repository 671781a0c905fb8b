"""Co-serving live (`policy: conserve`): a backlog of offline requests and
online requests that arrive behind it.  Offline requests are outside the
admission bound; online ones overtake them; every answer is the one the
FCFS application gives the same prompt (greedy, float32), though offline
requests were preempted back to their KV checkpoints (and offline passes
may have been cut between layers); the replica counts tokens by class."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.integration.conftest import reference_texts, wait_engine_idle

pytestmark = pytest.mark.integration

OFFLINE = [f"Write a long story about a {thing}." for thing in
           ("dragon", "robot", "lighthouse", "forest", "city", "river")]
ONLINE = ["What is the capital of France?", "Name three colors.", "Count to five."]
OFFLINE_TOKENS = 96


def body(prompt: str, n: int, job_class: str) -> dict:
    return {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "job_class": job_class}


async def _run(base: str, engine) -> tuple[list[tuple[dict, float]], list[tuple[dict, float]]]:
    async with httpx.AsyncClient(timeout=600) as c:
        async def one(prompt: str, n: int, job_class: str) -> tuple[dict, float]:
            r = await c.post(f"{base}/v1/completions", json=body(prompt, n, job_class))
            assert r.status_code == 200, r.text
            return r.json(), time.monotonic()

        def offline_tokens() -> int:
            return engine.stats.remote().result()["tokens_by_class"].get("offline", 0)

        offline = [asyncio.create_task(one(p, OFFLINE_TOKENS, "offline")) for p in OFFLINE]
        # The online requests arrive one by one while the backlog runs.
        deadline = time.monotonic() + 120
        while await asyncio.to_thread(offline_tokens) < len(OFFLINE):
            assert time.monotonic() < deadline, "the backlog did not start"
            await asyncio.sleep(0.1)
        online = []
        for p in ONLINE:
            online.append(asyncio.create_task(one(p, 8, "online")))
            await asyncio.sleep(1.0)  # the last one is done: offline batching again
        return await asyncio.gather(*offline), await asyncio.gather(*online)


def test_online_requests_overtake_an_offline_backlog(server, conserve_server, conserve_engine):
    offline, online = asyncio.run(_run(conserve_server, conserve_engine))
    stats = wait_engine_idle(conserve_engine, timeout=120)
    assert stats["policy"]["name"] == "conserve"
    assert stats["tokens_by_class"] == {"offline": OFFLINE_TOKENS * len(OFFLINE),
                                        "online": 8 * len(ONLINE)}
    # Whether an arrival cuts a pass depends on where it lands (between two
    # passes it does not), so the cut is asserted where it is deterministic:
    # tests/engine/test_layer_preemption.py and the engine loop's tests.
    # Offline requests that outgrew the cache were preempted back to their
    # checkpoints in the object-store tier, and resumed from them.
    swap = stats["swap"]
    assert swap["checkpoint_blocks"] > 0 and swap["checkpoint_discards"] > 0, swap
    assert swap["swap_ins"] >= swap["checkpoint_discards"]
    assert swap["recompute_fallbacks"] == 0 and swap["host_used_blocks"] == 0
    # The online requests, sent last, finished while the backlog still ran.
    assert max(t for _, t in online) < max(t for _, t in offline)
    cases = [(p, OFFLINE_TOKENS, got) for p, (got, _) in zip(OFFLINE, offline)]
    cases += [(p, 8, got) for p, (got, _) in zip(ONLINE, online)]
    refs = reference_texts(server, [
        {"prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        for p, n, _ in cases])
    for (p, _, got), ref in zip(cases, refs):
        assert got["choices"][0]["text"] == ref, p
