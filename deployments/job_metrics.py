"""What a finished job's client learns of where its time went (`JobMetrics`,
on the last chunk of its stream), and the latencies the replica's per-class
histograms count (deployments/engine_metrics.py)."""

from __future__ import annotations

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
    )


def finished_latency(job: Job) -> tuple[str, float, float | None] | None:
    """(class, TTFT, TPOT or None for a one-token answer) of a job that
    produced a token; None if it produced none."""
    if job.first_token_time is None or job.finish_time is None:
        return None
    n = job.num_output_tokens
    tpot = (job.finish_time - job.first_token_time) / (n - 1) if n > 1 else None
    return job.job_class.value, job.first_token_time - job.arrival_time, tpot
