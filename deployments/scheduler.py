"""The Scheduler deployment: cluster-level job registry and placement.

Stateful, one replica.  Engine replicas report their load to it; the
ingress asks it where a job goes and tells it when the job ended.  The
iteration-level decisions are not made here but in each engine replica
(ARCHITECTURE.md, "Why two levels").
"""

from __future__ import annotations

import time
from typing import Any

from ray import serve

from scheduler.placement import Placement


# Access logs off: engines report their load twice a second.
@serve.deployment(name="Scheduler", num_replicas=1, max_ongoing_requests=10_000,
                  logging_config={"enable_access_log": False})
class Scheduler:
    def __init__(self, stale_after_s: float = 10.0) -> None:
        self.placement = Placement(stale_after_s=stale_after_s)
        self.jobs: dict[str, dict[str, Any]] = {}
        self.outcomes: dict[str, int] = {}

    async def report_load(self, replica_id: str, num_blocks: int, free_blocks: int,
                          queued_tokens: int, num_jobs: int) -> None:
        self.placement.report(replica_id, num_blocks, free_blocks, queued_tokens,
                              num_jobs, time.monotonic())

    async def admit(self, request_id: str, prompt_tokens: int, max_tokens: int,
                    job_class: str = "online") -> str | None:
        replica = self.placement.place(request_id, prompt_tokens + max_tokens,
                                       time.monotonic())
        self.jobs[request_id] = {"class": job_class, "replica": replica,
                                 "admitted_at": time.time()}
        return replica

    async def release(self, request_id: str, outcome: str) -> None:
        self.placement.release(request_id)
        self.jobs.pop(request_id, None)
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    async def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "active_jobs": len(self.jobs),
            "outcomes": dict(self.outcomes),
            "replicas": {
                r.replica_id: {"free_blocks": r.free_blocks, "num_blocks": r.num_blocks,
                               "queued_tokens": r.queued_tokens, "num_jobs": r.num_jobs}
                for r in self.placement.live(now)
            },
        }
