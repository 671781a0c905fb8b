"""Cluster-level placement: which engine replica a new job goes to.

Each engine replica reports its load (queued tokens, free KV blocks) a few
times a second; between reports, jobs this placer sent are counted on top,
so a burst does not all land on the replica that looked idlest at the last
report.  Replicas that stop reporting are dropped (a killed replica).

`admit` adds admission control (scheduler/admission.py): a job goes only
to a replica whose queued work stays within its bound, and is refused, with
the time until the work should fit, when none has room.
"""

from __future__ import annotations

import math
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
    # Admission: tokens of jobs outside the running batch, the bound on
    # them, and the replica's measured throughput (tokens/s).
    waiting_tokens: int = 0
    capacity_tokens: float = math.inf
    tokens_per_s: float | None = None
    mean_output_len: float = 256.0

    @property
    def pressure(self) -> float:
        """Outstanding work relative to the replica's KV capacity."""
        return (self.queued_tokens + self.placed_tokens) / max(1, self.num_blocks)

    @property
    def backlog(self) -> int:
        """Queued work as admission counts it (placed jobs have not started)."""
        return self.waiting_tokens + self.placed_tokens

    def fits(self, tokens: int) -> bool:
        return self.backlog == 0 or self.backlog + tokens <= self.capacity_tokens

    def wait_s(self, tokens: int) -> float:
        """Seconds until `tokens` more would fit, at the measured speed."""
        excess = self.backlog + tokens - self.capacity_tokens
        if excess <= 0:
            return 0.0
        return excess / self.tokens_per_s if self.tokens_per_s else 1.0


@dataclass(frozen=True)
class AdmitResult:
    admitted: bool
    replica: str | None = None
    retry_after_s: float | None = None


class Placement:
    def __init__(self, stale_after_s: float = 10.0) -> None:
        self.stale_after_s = stale_after_s
        self.replicas: dict[str, ReplicaLoad] = {}
        self.job_replica: dict[str, str] = {}

    def report(self, replica_id: str, num_blocks: int, free_blocks: int,
               queued_tokens: int, num_jobs: int, now: float, waiting_tokens: int = 0,
               capacity_tokens: float = math.inf, tokens_per_s: float | None = None,
               mean_output_len: float | None = None) -> None:
        r = self.replicas.get(replica_id)
        if r is None:
            r = self.replicas[replica_id] = ReplicaLoad(replica_id, num_blocks)
        r.num_blocks = num_blocks
        r.free_blocks = free_blocks
        r.queued_tokens = queued_tokens
        r.num_jobs = num_jobs
        r.reported_at = now
        r.placed_tokens = 0
        r.waiting_tokens = waiting_tokens
        r.capacity_tokens = capacity_tokens
        r.tokens_per_s = tokens_per_s
        if mean_output_len is not None:
            r.mean_output_len = mean_output_len

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

    def admit(self, job_id: str, prompt_tokens: int, max_tokens: int, n: int,
              now: float) -> AdmitResult:
        """Place `job_id` on the least-pressured replica with room for its
        expected work, or refuse it when none has room."""
        from scheduler.admission import request_work

        live = self.live(now)
        if not live:
            return AdmitResult(True, None)
        fits = {}
        for r in live:
            work = request_work(prompt_tokens, max_tokens, n, r.mean_output_len)
            if r.fits(work):
                fits[r.replica_id] = work
        if not fits:
            wait = min(r.wait_s(request_work(prompt_tokens, max_tokens, n, r.mean_output_len))
                       for r in live)
            return AdmitResult(False, None, max(wait, 0.5))
        best = min((r for r in live if r.replica_id in fits),
                   key=lambda r: (r.pressure, r.replica_id))
        best.placed_tokens += fits[best.replica_id]
        self.job_replica[job_id] = best.replica_id
        return AdmitResult(True, best.replica_id)

    def release(self, job_id: str) -> None:
        self.job_replica.pop(job_id, None)
