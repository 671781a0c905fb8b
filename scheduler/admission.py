"""Admission control: a bound on each replica's queued work, in tokens.

A request that would wait past the TTFT objective is better refused at once
(429 with Retry-After) than admitted to a queue that makes it, and everyone
behind it, late.  Under FCFS with a full batch, a job reaches the batch once
the jobs ahead of it have run: a replica that computes `mu` tokens/s starts
it after about (queued tokens ahead) / mu seconds.  So the default bound on
queued work is `ttft_slo_s * mu`, with `mu` the replica's measured
throughput when its batch is full.  Policies that let new jobs overtake
(MLFQ) only start them sooner; the bound is conservative for them.

Queued work counts the tokens still to compute of jobs outside the running
batch (the latest plan's): their uncomputed prompt (or recomputation) plus
their expected remaining output: the predictor's estimate when it has
landed, otherwise the replica's mean output length, never more than
`max_tokens`.  Outside the batch, not "never started": under MLFQ most jobs
have started and wait preempted in lower queues.  A replica
with nothing queued admits any request, however large, so that no request
is refused forever.

Under co-serving (`policy: conserve`) offline work is neither bounded nor
counted: it has no TTFT objective, and every online job runs ahead of it
(ConServe §4.2), so a backlog of batch work delays no online request.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from scheduler.job import Job, JobClass


@dataclass(frozen=True)
class AdmissionBound:
    ttft_slo_s: float
    # Fixed bound per replica; None: derived from the measured throughput.
    max_queued_tokens: int | None = None

    def capacity(self, tokens_per_s: float | None) -> float:
        """Queued tokens a replica computing `tokens_per_s` may hold."""
        if self.max_queued_tokens is not None:
            return float(self.max_queued_tokens)
        if not tokens_per_s:
            return math.inf  # not measured yet: nothing to bound by
        return self.ttft_slo_s * tokens_per_s


def bounded(job_class: str, policy: str) -> bool:
    """Whether a job of `job_class` is subject to the bound, and counts in
    queued work, under `policy`."""
    return not (policy == "conserve" and job_class == JobClass.OFFLINE.value)


def expected_output(job: Job, mean_output_len: float) -> float:
    guess = job.predicted_output_len if job.predicted_output_len is not None else mean_output_len
    return min(float(job.max_tokens), guess)


def queued_work(jobs: Iterable[Job], batch: Collection[str], mean_output_len: float) -> int:
    """Tokens still to compute for the jobs outside the running `batch`."""
    total = 0.0
    for job in jobs:
        if job.job_id in batch:
            continue
        left_out = max(0.0, expected_output(job, mean_output_len) - job.num_output_tokens)
        total += job.num_uncomputed_tokens + left_out
    return int(total)


def request_work(prompt_tokens: int, max_tokens: int, n: int, mean_output_len: float) -> int:
    """Expected tokens of a new request of `n` choices."""
    return prompt_tokens + int(n * min(float(max_tokens), mean_output_len))


class MeanOutput:
    """Running mean of finished jobs' output lengths (exponential, so it
    follows a workload that changes)."""

    def __init__(self, initial: float, weight: float = 0.05) -> None:
        self.value = initial
        self.weight = weight
        self.samples = 0

    def add(self, num_tokens: int) -> None:
        # The first samples replace the prior faster than the EWMA would.
        w = max(self.weight, 1.0 / (self.samples + 1))
        self.value += w * (num_tokens - self.value)
        self.samples += 1
