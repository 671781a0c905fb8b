"""Anthropic's Message Batches API as the wire shows it: the create body,
the MessageBatch object and the results lines, made from this server's
batches (a Message Batch is a batch of `/v1/messages` lines run by its
Ray Job as any other; batch/message_batch_routes.py serves the routes).

| Batch (OpenAI's status) | `processing_status` |
| --- | --- |
| validating, in_progress | in_progress |
| cancelling | canceling |
| completed, failed, cancelled, expired | ended |

`request_counts`: `succeeded` (output lines), `errored` (error lines but
expired ones), `expired`, `canceled` (lines without a result once a
cancelled or failed batch ended) and `processing` (the rest while it runs).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.batch import BatchObject, BatchOutputLine
from api.messages_api import iso_utc

EXPIRED_CODE = "batch_expired"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class BatchedRequest(_Strict):
    custom_id: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    # A Messages request; checked as `/v1/messages` checks one when its line runs.
    params: dict[str, Any]


class MessageBatchCreate(_Strict):
    """`POST /v1/messages/batches`."""

    requests: list[BatchedRequest] = Field(..., min_length=1, max_length=100_000)


class MessageBatchListQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    limit: int = Field(20, ge=1, le=1000)
    after_id: str | None = None
    before_id: str | None = None


def message_batch(obj: BatchObject, output: list[BatchOutputLine],
                  errors: list[BatchOutputLine]) -> dict[str, Any]:
    """The MessageBatch of batch `obj`, with its results files' lines."""
    status = obj.status
    processing: Literal["in_progress", "canceling", "ended"] = (
        "in_progress" if status in ("validating", "in_progress") else
        "canceling" if status == "cancelling" else "ended")
    expired = sum(1 for e in errors if _code(e) == EXPIRED_CODE)
    succeeded = obj.request_counts.completed
    errored = obj.request_counts.failed - expired
    left = max(0, obj.request_counts.total - succeeded - errored - expired)
    ended_at = (obj.completed_at or obj.failed_at or obj.cancelled_at or obj.expired_at)
    return {
        "id": obj.id, "type": "message_batch", "processing_status": processing,
        "request_counts": {"processing": 0 if processing == "ended" else left,
                           "succeeded": succeeded, "errored": errored,
                           "canceled": left if processing == "ended" else 0,
                           "expired": expired},
        "created_at": _iso(obj.created_at),
        "expires_at": _iso(obj.expires_at),
        "ended_at": _iso(ended_at) if processing == "ended" else None,
        "cancel_initiated_at": _iso(obj.cancelling_at),
        "archived_at": None,
        "results_url": (f"/v1/messages/batches/{obj.id}/results" if processing == "ended"
                        else None),
    }


def result_line(line: BatchOutputLine) -> dict[str, Any]:
    """One line of a Message Batch's results."""
    response = line.response
    if response is not None and response.status_code == 200:
        return {"custom_id": line.custom_id, "result": {"type": "succeeded",
                                                        "message": response.body}}
    if _code(line) == EXPIRED_CODE:
        return {"custom_id": line.custom_id, "result": {"type": "expired"}}
    if response is not None:
        error = response.body if response.body.get("type") == "error" else {
            "type": "error", "error": {"type": "api_error",
                                       "message": str(response.body)}}
    else:
        assert line.error is not None
        error = {"type": "error", "error": {"type": "invalid_request_error",
                                            "message": line.error.message}}
    return {"custom_id": line.custom_id, "result": {"type": "errored", "error": error}}


def _code(line: BatchOutputLine) -> str | None:
    return line.error.code if line.error is not None else None


def _iso(seconds: int | None) -> str | None:
    return None if seconds is None else iso_utc(seconds)
