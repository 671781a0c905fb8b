"""What a finished job's client learns of where its time went (`JobMetrics`,
on the last chunk of its stream), and what the replica's dashboard figures
count of it (deployments/engine_metrics.py)."""

from __future__ import annotations

from typing import NamedTuple

from api.protocol import JobMetrics
from scheduler.job import Job


def job_metrics(job: Job) -> JobMetrics:
    arrival = job.arrival_time
    return JobMetrics(
        queue_time=(job.first_scheduled_time or arrival) - arrival,
        ttft=(job.first_token_time or arrival) - arrival,
        e2e=(job.finish_time or arrival) - arrival,
        execution_time=job.attained_service,
        swap_wait_time=job.swap_wait_time,
        num_preemptions=job.num_preemptions,
        predicted_output_len=job.predicted_output_len,
        prediction_delay=(None if job.prediction_time is None
                          else max(0.0, job.prediction_time - arrival)),
        cached_tokens=job.num_cached_tokens,
        **({} if job.prediction is None else {
            "accepted_prediction_tokens": job.num_prediction_accepted,
            "rejected_prediction_tokens": job.num_prediction_drafted
            - job.num_prediction_accepted}),
    )


class FinishedJob(NamedTuple):
    """A finished job as the replica's dashboard figures count it."""

    job_class: str
    # "stop", "length" or "abort" (the client went away).
    finish_reason: str
    queue_time: float
    # None for a job that produced no token.
    ttft: float | None
    # None for an answer of fewer than two tokens.
    tpot: float | None
    e2e: float
    prompt_tokens: int
    output_tokens: int


def finished_record(job: Job) -> FinishedJob:
    arrival = job.arrival_time
    finish = job.finish_time if job.finish_time is not None else arrival
    n = job.num_output_tokens
    first = job.first_token_time
    return FinishedJob(
        job_class=job.job_class.value,
        finish_reason=job.finish_reason or "abort",
        queue_time=(job.first_scheduled_time or finish) - arrival,
        ttft=None if first is None else first - arrival,
        tpot=(finish - first) / (n - 1) if first is not None and n > 1 else None,
        e2e=finish - arrival,
        prompt_tokens=job.num_prompt_tokens,
        output_tokens=n,
    )
