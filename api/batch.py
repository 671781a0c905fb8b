"""OpenAI's Files and Batch API shapes, and what a batch job and the
ingress say to each other.

The input file's lines, the output and error files' lines, the File and
Batch objects and the batch creation request are OpenAI's
(https://platform.openai.com/docs/api-reference/batch), so that the
`openai` client and files written for OpenAI's Batch API work unchanged.
Strict as the completion requests are: an OpenAI field we do not implement
is refused by name, a field nobody defines as unrecognized.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# The endpoints a batch may target: the ones this server serves.
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]

# OpenAI's bounds on `metadata`.
MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]
Metadata = dict[MetadataKey, MetadataValue]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class BatchInputLine(_Strict):
    """One line of a batch input file."""

    custom_id: str = Field(..., min_length=1, max_length=512)
    method: Literal["POST"]
    url: Endpoint
    body: dict[str, Any]


class BatchResponse(BaseModel):
    """The answer to one request of a batch: what `Ingress.batch_request`
    returns, and an output (or error) line's `response`.  `body` is the
    OpenAI response body, or the OpenAI error body for a non-200."""

    status_code: int
    request_id: str | None = None
    body: dict[str, Any]


class BatchError(BaseModel):
    """Why a line was never sent (OpenAI's batch error entry)."""

    code: str
    message: str
    # The line of the input file, counted from 1.
    line: int | None = None
    param: str | None = None


class BatchOutputLine(BaseModel):
    """One line of a batch's output or error file."""

    id: str
    custom_id: str | None
    response: BatchResponse | None = None
    error: BatchError | None = None


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class FileListQuery(BaseModel):
    """`GET /v1/files`'s query (OpenAI's): newest first unless `order` is
    `asc`, `after` a file id, `purpose` a filter."""

    model_config = ConfigDict(extra="forbid")

    limit: int = Field(10000, ge=1, le=10000)
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None
    purpose: str | None = None


class ExpiresAfter(_Strict):
    """OpenAI's expiration policy of a file: `seconds` after its creation."""

    anchor: Literal["created_at"]
    seconds: int = Field(..., ge=3600, le=2592000)


class UploadExpiry(_Strict):
    """An upload's `expires_after` form fields, gathered."""

    expires_after: ExpiresAfter


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed",
                      "expired", "cancelling", "cancelled"]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    usage: BatchUsage | None = None
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class BatchCreateRequest(_Strict):
    """`POST /v1/batches`."""

    input_file_id: str
    endpoint: Endpoint
    # OpenAI offers only "24h"; the server's is `batch.completion_window_hours`.
    completion_window: Literal["24h"]
    metadata: Metadata | None = Field(None, max_length=16)
    # When the output and error files expire (from their creation, with the
    # batch); None: kept until deleted.
    output_expires_after: ExpiresAfter | None = None


class BatchListQuery(BaseModel):
    """`GET /v1/batches`'s query: newest first, `after` a batch id."""

    model_config = ConfigDict(extra="forbid")

    limit: int = Field(20, ge=1, le=100)
    after: str | None = None
