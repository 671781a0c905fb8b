"""The engine replicas' request router, without a running Serve."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from ray.serve.request_router import PendingRequest

from deployments.routing import PlacementRouter


def _replica(rid: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid))


def _choose(kwargs: dict) -> tuple[list, PendingRequest]:
    async def run() -> tuple[list, PendingRequest]:
        pending = PendingRequest(args=[], kwargs=kwargs, metadata=SimpleNamespace())
        # choose_replicas reads no router state: no Serve controller needed.
        router = PlacementRouter.__new__(PlacementRouter)
        chosen = await router.choose_replicas([_replica("a"), _replica("b")], pending)
        return chosen, pending

    return asyncio.run(run())


def test_the_scheduler_choice_wins_and_busy_retries_back_off():
    chosen, pending = _choose({"replica": "b"})
    assert [[r.replica_id.unique_id for r in group] for group in chosen] == [["b"]]
    # Serve's retry loop (RequestRouter._choose_replicas_with_backoff)
    # sleeps between tries of a busy replica only with this set.
    assert pending.routing_context.should_backoff


def test_without_a_choice_or_with_a_gone_replica_every_candidate():
    for kwargs in ({}, {"replica": "gone"}):
        chosen, pending = _choose(kwargs)
        assert [[r.replica_id.unique_id for r in group] for group in chosen] == [["a", "b"]]
        assert pending.routing_context.should_backoff
