"""A batch's OpenAI Batch object, from what can be observed: its record,
the results files its job wrote, and the Ray Job's state.

| Ray Job (the batch's latest run) | status |
| --- | --- |
| PENDING | validating (cancelling once a cancel was asked) |
| RUNNING | in_progress (cancelling once a cancel was asked) |
| SUCCEEDED | completed |
| STOPPED | cancelled |
| FAILED | failed (cancelled if a cancel was asked) |
| none (never submitted, or Ray forgot it) | completed if every line has a result, else failed |

A batch whose run found its completion window ended (`expired_at`) is
`expired`, whatever its job says.

The counts are the lines of the files (output: completed; errors: failed),
so they are right after a resume too, or the tally a deleted file left in
the record; the output and error file ids are shown once their files hold
a line.
"""

from __future__ import annotations

from api.batch import (
    BatchError,
    BatchErrors,
    BatchObject,
    BatchOutputLine,
    BatchStatus,
    BatchUsage,
    RequestCounts,
)
from batch.jobs import JobView
from batch.store import BatchRecord


def batch_usage(output: list[BatchOutputLine]) -> BatchUsage | None:
    """The tokens of the answers: chat and completions name them
    `prompt_tokens` / `completion_tokens`, Responses `input_tokens` /
    `output_tokens`."""
    if not output:
        return None
    prompt = completion = 0
    for line in output:
        usage = line.response.body.get("usage") if line.response else None
        if isinstance(usage, dict):
            prompt += int(usage.get("prompt_tokens", usage.get("input_tokens", 0)))
            completion += int(usage.get("completion_tokens", usage.get("output_tokens", 0)))
    return _usage(prompt, completion)


def _usage(prompt: int, completion: int) -> BatchUsage:
    return BatchUsage(input_tokens=prompt, output_tokens=completion,
                      total_tokens=prompt + completion)


def _seconds(ms: int | None) -> int | None:
    return None if ms is None else ms // 1000


def batch_object(record: BatchRecord, output: list[BatchOutputLine],
                 errors: list[BatchOutputLine], job: JobView | None) -> BatchObject:
    usage = batch_usage(output)
    completed, failed = len(output), len(errors)
    if (tally := record.deleted_results.get("output")) is not None:
        completed = tally.lines
        usage = _usage(tally.input_tokens, tally.output_tokens) if tally.lines else None
    if (tally := record.deleted_results.get("errors")) is not None:
        failed = tally.lines
    counts = RequestCounts(total=record.total, completed=completed, failed=failed)
    obj = BatchObject(
        id=record.id, endpoint=record.endpoint, model=record.model,
        input_file_id=record.input_file_id, completion_window=record.completion_window,
        status=_status(record, counts, job), created_at=record.created_at,
        output_file_id=record.output_file_id if completed else None,
        error_file_id=record.error_file_id if failed else None,
        request_counts=counts, usage=usage, metadata=record.metadata,
        cancelling_at=record.cancel_requested_at, expires_at=record.expires_at,
        expired_at=record.expired_at)
    if job is None:
        if obj.status == "failed":
            obj.errors = BatchErrors(data=[BatchError(
                code="job_missing", message="no Ray Job of this batch is known to the "
                "cluster; resume it (`preempt-serve batch resume`)")])
        return obj
    if job.status != "PENDING":
        obj.in_progress_at = _seconds(job.start_time)
    end = _seconds(job.end_time)
    if obj.status == "completed":
        obj.completed_at = end
    elif obj.status == "cancelled":
        obj.cancelled_at = end
    elif obj.status == "failed":
        obj.failed_at = end
        obj.errors = BatchErrors(data=[BatchError(
            code="job_failed", message=job.message or "the batch job failed")])
    return obj


def _status(record: BatchRecord, counts: RequestCounts, job: JobView | None) -> BatchStatus:
    if record.expired_at is not None:
        return "expired"
    cancelling = record.cancel_requested_at is not None
    if job is None:
        done = counts.completed + counts.failed >= counts.total
        return "completed" if done else "failed"
    if job.status == "PENDING":
        return "cancelling" if cancelling else "validating"
    if job.status == "RUNNING":
        return "cancelling" if cancelling else "in_progress"
    if job.status == "SUCCEEDED":
        return "completed"
    if job.status == "STOPPED" or cancelling:
        return "cancelled"
    return "failed"
