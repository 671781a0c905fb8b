"""Clairvoyant scheduling orders, for the simulator only: a bound on what any
order of the same jobs can gain over FCFS on a given workload.

They read each job's true answer length (`max_tokens`, exact under
`ignore_eos`), which no server knows, so they are registered by the bench
CLI and never offered by the serving config.  Both reuse the MLFQ policy's
machinery (iteration-level preemption, proactive swapping) with a different
order, so a gap between them and `mlfq` is the price of not knowing the
lengths, not of the mechanics:

- `oracle-srpt`: shortest remaining answer first (SRPT, optimal for mean
  latency on one server).
- `oracle-sjf`: shortest whole answer first, preemptive (a newcomer with a
  shorter answer overtakes a running job however far along it is); it
  weighs short jobs as normalized latency does.
"""

from __future__ import annotations

from scheduler.job import Job
from scheduler.policies import POLICIES
from scheduler.policies.mlfq import MLFQPolicy
from scheduler.policies.walk import Walk


class _OraclePolicy(MLFQPolicy):
    # "fixed": no demotion or starvation promotion; the order below decides.
    variant = "fixed"

    def key(self, job: Job) -> float:
        raise NotImplementedError

    def _positions(self) -> tuple[list[Job], dict[str, int]]:
        order = sorted(self.jobs(), key=self.key)
        return order, {j.job_id: i for i, j in enumerate(order)}

    def walk(self) -> Walk:
        order, pos = self._positions()
        return Walk(order, lambda j: pos[j.job_id])

    def _ranking(self, now: float) -> "_OrderRanking":
        # Swap victims and prefetches follow the same order as the batch.
        return _OrderRanking(self._positions()[1])

    def enst(self, now: float) -> dict[str, float]:
        return {jid: float(i) for jid, i in self._positions()[1].items()}


class _OrderRanking:
    """The clairvoyant order in place of ENST (`scheduler/policies/enst.py`):
    not the walk's rank, so jobs holding KV are sorted by it in full."""

    walk_order = False
    single_class = False

    def __init__(self, pos: dict[str, int]) -> None:
        self._pos = pos

    def value(self, job: Job) -> float:
        return float(self._pos[job.job_id])

    def key(self, job: Job) -> tuple[int, float]:
        return (job.priority, float(self._pos[job.job_id]))


class ShortestRemainingPolicy(_OraclePolicy):
    name = "oracle-srpt"

    def key(self, job: Job) -> float:
        return job.max_tokens - job.num_output_tokens


class ShortestJobPolicy(_OraclePolicy):
    name = "oracle-sjf"

    def key(self, job: Job) -> float:
        return job.max_tokens


def register() -> None:
    for p in (ShortestRemainingPolicy, ShortestJobPolicy):
        POLICIES.setdefault(p.name, p)
