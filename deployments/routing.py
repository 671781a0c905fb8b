"""Serve request router for engine replicas: honour the scheduler's choice.

The Scheduler deployment decides which engine replica runs a job
(`scheduler/placement.py`); the ingress passes that replica's id as the
`replica` keyword of `Engine.generate`, and this router sends the request
there.  Without a choice (or if that replica is gone) it falls back to the
least-loaded candidate by Serve's own queue-length view.  Either way Serve
backs off between tries when the replica is busy.
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class PlacementRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if pending_request is not None:
            # Serve retries a request whose chosen replica is busy; it sleeps
            # between tries only when the router says so.  Left False (as
            # Serve's locality pass sets it for the first, same-node try),
            # the retry loop spins without yielding the CPU.
            pending_request.routing_context.should_backoff = True
        target = pending_request.kwargs.get("replica") if pending_request else None
        if target:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if chosen:
                return [chosen]
        return [candidate_replicas]
