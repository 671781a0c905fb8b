"""Cluster-level placement: which engine replica a new job goes to.

Each engine replica reports its load (queued tokens, free KV blocks) a few
times a second; between reports, jobs this placer sent are counted on top,
so a burst does not all land on the replica that looked idlest at the last
report.  Replicas that stop reporting are dropped (a killed replica).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReplicaLoad:
    replica_id: str
    num_blocks: int
    free_blocks: int = 0
    queued_tokens: int = 0  # tokens still to compute for its jobs
    num_jobs: int = 0
    reported_at: float = 0.0
    # Tokens of jobs placed since the last report.
    placed_tokens: int = 0

    @property
    def pressure(self) -> float:
        """Outstanding work relative to the replica's KV capacity."""
        return (self.queued_tokens + self.placed_tokens) / max(1, self.num_blocks)


class Placement:
    def __init__(self, stale_after_s: float = 10.0) -> None:
        self.stale_after_s = stale_after_s
        self.replicas: dict[str, ReplicaLoad] = {}
        self.job_replica: dict[str, str] = {}

    def report(self, replica_id: str, num_blocks: int, free_blocks: int,
               queued_tokens: int, num_jobs: int, now: float) -> None:
        r = self.replicas.get(replica_id)
        if r is None:
            r = self.replicas[replica_id] = ReplicaLoad(replica_id, num_blocks)
        r.num_blocks = num_blocks
        r.free_blocks = free_blocks
        r.queued_tokens = queued_tokens
        r.num_jobs = num_jobs
        r.reported_at = now
        r.placed_tokens = 0

    def live(self, now: float) -> list[ReplicaLoad]:
        for rid in [r.replica_id for r in self.replicas.values()
                    if now - r.reported_at > self.stale_after_s]:
            del self.replicas[rid]
        return list(self.replicas.values())

    def place(self, job_id: str, tokens: int, now: float) -> str | None:
        """The replica for `job_id`, or None when no replica has reported."""
        live = self.live(now)
        if not live:
            return None
        best = min(live, key=lambda r: (r.pressure, r.replica_id))
        best.placed_tokens += tokens
        self.job_replica[job_id] = best.replica_id
        return best.replica_id

    def release(self, job_id: str) -> None:
        self.job_replica.pop(job_id, None)
