"""Cluster-level placement: which engine replica a new job goes to.

Each engine replica reports its load (queued tokens, free KV blocks) a few
times a second; jobs this placer sent are counted on top until a report
counts them, so a burst does not all land on the replica that looked idlest
at the last report.  A replica's report names the requests it has taken in
since the one before (`arrived`): under a burst a request admitted here may
take longer than a report interval to reach its replica (the ingress opens
its stream after the admission; the replica takes it in at its next
iteration), and a report that did not count it must not make it vanish.
Replicas that stop reporting are dropped (a killed replica).

`admit` adds admission control (scheduler/admission.py): a job goes only
to a replica where its estimated TTFT is within the objective (or where
nothing is ahead of it) and its queued work within the backlog bound, the
one with the shortest estimate, and is refused, with the time until it
should fit, when none has room.  A replica that
reports no prefill load (or a fixed bound is configured) is judged by its
queued tokens against the bound instead.

Both weigh where a prompt's leading blocks are likely cached
(`scheduler/prefix_affinity.py`): on such a replica the job's prompt work,
and so its TTFT estimate, is smaller by the cached tokens, so a request
goes where its prefix is unless that replica is busier by more than the
prefill it saves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from scheduler.admission import PrefillLoad, request_work, ttft_estimate
from scheduler.prefix_affinity import PrefixAffinity


@dataclass
class ReplicaLoad:
    replica_id: str
    num_blocks: int
    free_blocks: int = 0
    queued_tokens: int = 0  # tokens still to compute for its jobs
    num_jobs: int = 0
    reported_at: float = 0.0
    # Admission: tokens of jobs outside the running batch, the bound on
    # them, and the replica's measured throughput (tokens/s).
    waiting_tokens: int = 0
    capacity_tokens: float = math.inf
    tokens_per_s: float | None = None
    mean_output_len: float = 256.0
    # For the TTFT estimate; None: the token bound above decides.
    prefill: PrefillLoad | None = None
    ttft_slo_s: float | None = None
    # With the estimate: per queue a newcomer may join, [longest prompt
    # joining it, jobs in it or above, tokens they compute before leaving
    # it] (scheduler/policies/mlfq_admission.py); None: every queued job is
    # ahead once the batch is full.  And the most queued work it admits to.
    levels: list[list[int]] | None = None
    backlog_capacity_tokens: float = math.inf
    # Jobs placed here that its reports have not counted yet:
    # id -> (tokens, prompt tokens, jobs, when placed).
    in_transit: dict[str, tuple[int, int, int, float]] = field(default_factory=dict)
    # Jobs a report counted before they were placed here (sent ahead of
    # their admission, deployments/dispatch_ahead.py): id -> when reported.
    ahead_of_placing: dict[str, float] = field(default_factory=dict)

    @property
    def placed_tokens(self) -> int:
        return sum(t for t, _, _, _ in self.in_transit.values())

    @property
    def placed_prefill(self) -> int:
        return sum(p for _, p, _, _ in self.in_transit.values())

    @property
    def placed_jobs(self) -> int:
        return sum(j for _, _, j, _ in self.in_transit.values())

    def place(self, job_id: str, tokens: int, prompt: int, jobs: int, now: float) -> None:
        if self.ahead_of_placing.pop(job_id, None) is not None:
            return  # a report counts it already
        # Placed again (resumed): counted once.
        self.in_transit[job_id] = (tokens, prompt, jobs, now)

    def arrive(self, job_id: str) -> None:
        """`job_id` is counted by the replica's report (or gone)."""
        self.in_transit.pop(job_id, None)

    def work_with(self, tokens: int) -> float:
        """Outstanding work with `tokens` more, relative to KV capacity."""
        return (self.queued_tokens + self.placed_tokens + tokens) / max(1, self.num_blocks)

    @property
    def backlog(self) -> int:
        """Queued work as admission counts it (placed jobs have not started)."""
        return self.waiting_tokens + self.placed_tokens

    def fits(self, tokens: int) -> bool:
        return self.backlog == 0 or self.backlog + tokens <= self.capacity_tokens

    def ttft_s(self, prompt_tokens: int) -> float | None:
        """Estimated TTFT of a newcomer with a prompt of `prompt_tokens`;
        None when this replica reports no prefill load."""
        pf = self.prefill
        if pf is None:
            return None
        t = ttft_estimate(pf, prompt_tokens, self.placed_prefill, self.placed_jobs)
        mu = self.tokens_per_s
        if self.levels:
            # Skip-join MLFQ: only the jobs of its queue and those above, if
            # they fill the batch (placed jobs counted among them).
            _, above, ahead = next((lv for lv in self.levels if prompt_tokens <= lv[0]),
                                   self.levels[-1])
            if above + self.placed_jobs >= pf.max_batch_size and mu:
                t += (ahead + self.placed_tokens) / mu
        elif pf.jobs + self.placed_jobs >= pf.max_batch_size and mu:
            # No free slot: the work outside the batch runs first.
            t += self.backlog / mu
        return t

    def backlog_fits(self, tokens: int) -> bool:
        """Whether `tokens` more queued work stays within the backlog bound."""
        return self.backlog == 0 or self.backlog + tokens <= self.backlog_capacity_tokens

    def starts_at_once(self) -> bool:
        """Nothing is ahead of a newcomer: no prompt to compute, a free slot."""
        pf = self.prefill
        return (pf is not None and pf.prefill_tokens + self.placed_prefill == 0
                and pf.jobs + self.placed_jobs < pf.max_batch_size)

    def wait_s(self, tokens: int) -> float:
        """Seconds until `tokens` more would fit, at the measured speed."""
        return self._drain_s(self.backlog + tokens - self.capacity_tokens)

    def backlog_wait_s(self, tokens: int) -> float:
        """Seconds until `tokens` more would fit the backlog bound."""
        return self._drain_s(self.backlog + tokens - self.backlog_capacity_tokens)

    def _drain_s(self, excess: float) -> float:
        if excess <= 0:
            return 0.0
        return excess / self.tokens_per_s if self.tokens_per_s else 1.0


@dataclass(frozen=True)
class AdmitResult:
    admitted: bool
    replica: str | None = None
    retry_after_s: float | None = None


class Placement:
    def __init__(self, stale_after_s: float = 10.0, block_size: int = 16) -> None:
        self.stale_after_s = stale_after_s
        self.block_size = block_size
        self.replicas: dict[str, ReplicaLoad] = {}
        self.job_replica: dict[str, str] = {}
        self.affinity = PrefixAffinity()
        # Placements that went to a replica holding some of the prompt.
        self.num_prefix_placements = 0

    def _cached(self, live: list[ReplicaLoad], keys: list[int] | None,
                route: int | None = None) -> dict[str, int]:
        """Tokens of the prompt each live replica likely has cached.  A
        replica that got the client's `route` key (`prompt_cache_key`)
        counts as holding every block the prompt has keys for: the client
        says its requests share their beginning."""
        ids = {r.replica_id for r in live}
        depth = self.affinity.match(keys, ids) if keys else {}
        if route is not None and keys:
            for r in self.affinity.match([route], ids):
                depth[r] = len(keys)
        return {r: d * self.block_size for r, d in depth.items()}

    def _placed(self, job_id: str, replica: str, keys: list[int] | None,
                cached: dict[str, int], route: int | None = None) -> None:
        self.job_replica[job_id] = replica
        if keys:
            self.affinity.record(keys, replica)
        if route is not None:
            self.affinity.record([route], replica)
        if cached.get(replica):
            self.num_prefix_placements += 1

    def report(self, replica_id: str, num_blocks: int, free_blocks: int,
               queued_tokens: int, num_jobs: int, now: float, waiting_tokens: int = 0,
               capacity_tokens: float = math.inf, tokens_per_s: float | None = None,
               mean_output_len: float | None = None,
               prefill: dict[str, Any] | None = None,
               ttft_slo_s: float | None = None,
               arrived: list[str] | None = None,
               levels: list[list[int]] | None = None,
               backlog_capacity_tokens: float = math.inf) -> None:
        """`arrived`: the jobs the replica took in since its last report,
        counted by this one; None: every job placed so far (a replica that
        takes jobs in at once, as the simulator's do)."""
        r = self.replicas.get(replica_id)
        if r is None:
            r = self.replicas[replica_id] = ReplicaLoad(replica_id, num_blocks)
        r.num_blocks = num_blocks
        r.free_blocks = free_blocks
        r.queued_tokens = queued_tokens
        r.num_jobs = num_jobs
        r.reported_at = now
        for job_id in arrived or ():
            if job_id not in r.in_transit:
                r.ahead_of_placing[job_id] = now
        for job_id in [j for j, at in r.ahead_of_placing.items() if now - at > self.stale_after_s]:
            del r.ahead_of_placing[job_id]  # never placed here: refused, or placed elsewhere
        gone = list(r.in_transit) if arrived is None else [
            *arrived,
            # Placed long ago and never reported: the request ended before
            # its stream opened, or the report naming it was lost.
            *(j for j, (_, _, _, at) in r.in_transit.items()
              if now - at > self.stale_after_s)]
        for job_id in gone:
            r.arrive(job_id)
        r.prefill = PrefillLoad(**prefill) if prefill is not None else None
        r.ttft_slo_s = ttft_slo_s
        r.levels = levels
        r.backlog_capacity_tokens = backlog_capacity_tokens
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

    def place(self, job_id: str, tokens: int, now: float,
              prefix_keys: list[int] | None = None, route_key: int | None = None) -> str | None:
        """The replica for `job_id` (`tokens` of work, of which the leading
        blocks `prefix_keys` stand for), or None when no replica has
        reported: the least loaded one counting the prompt it has cached."""
        live = self.live(now)
        if not live:
            return None
        cached = self._cached(live, prefix_keys, route_key)
        best = min(live, key=lambda r: (r.work_with(tokens - cached.get(r.replica_id, 0)),
                                        r.replica_id))
        best.place(job_id, tokens - cached.get(best.replica_id, 0), 0, 0, now)
        self._placed(job_id, best.replica_id, prefix_keys, cached, route_key)
        return best.replica_id

    def admit(self, job_id: str, prompt_tokens: int, max_tokens: int, n: int,
              now: float, prefix_keys: list[int] | None = None,
              route_key: int | None = None) -> AdmitResult:
        """Place `job_id` where its first token should come within the
        objective (the soonest such replica, counting the prompt it has
        cached), or refuse it when none can."""
        live = self.live(now)
        if not live:
            return AdmitResult(True, None)
        cached = self._cached(live, prefix_keys, route_key)
        fits: dict[str, tuple[float, int, int]] = {}
        waits: list[float] = []
        for r in live:
            # It computes at least its last prompt token.
            prompt = max(1, prompt_tokens - cached.get(r.replica_id, 0))
            work = request_work(prompt, max_tokens, n, r.mean_output_len)
            est = r.ttft_s(prompt)
            if est is None or r.ttft_slo_s is None:
                if r.fits(work):
                    fits[r.replica_id] = (r.work_with(work), work, prompt)
                else:
                    waits.append(r.wait_s(work))
            elif not r.backlog_fits(work):
                waits.append(r.backlog_wait_s(work))
            elif est <= r.ttft_slo_s or r.starts_at_once():
                fits[r.replica_id] = (est, work, prompt)
            else:
                waits.append(est - r.ttft_slo_s)
        if not fits:
            return AdmitResult(False, None, max(min(waits), 0.5))
        best = min((r for r in live if r.replica_id in fits),
                   key=lambda r: (fits[r.replica_id][0], r.replica_id))
        _, work, prompt = fits[best.replica_id]
        best.place(job_id, work, prompt, n, now)
        self._placed(job_id, best.replica_id, prefix_keys, cached, route_key)
        return AdmitResult(True, best.replica_id)

    def release(self, job_id: str) -> None:
        replica = self.replicas.get(self.job_replica.pop(job_id, ""))
        if replica is not None:
            replica.arrive(job_id)

    def forget(self, replica_id: str) -> None:
        """Drop a replica known to have failed; its next report (if it lives
        on) brings it back, with none of the prefixes it held."""
        self.replicas.pop(replica_id, None)
        self.affinity.forget(replica_id)
