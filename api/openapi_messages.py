"""The `/v1/messages` part of `GET /openapi.json` (api/openapi.py builds the
document; deployments/messages_route.py serves the routes).  Its errors
have Anthropic's shape (`AnthropicErrorResponse`), but a 401, which the
auth layer answers in OpenAI's."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from api.message_batches import MessageBatchCreate
from api.messages_api import AnthropicErrorResponse, CountTokensRequest, MessagesRequest
from api.openapi_conversations import param

MODELS: list[tuple[type[BaseModel], Any]] = [
    (MessagesRequest, "validation"),
    (CountTokensRequest, "validation"),
    (MessageBatchCreate, "validation"),
    (AnthropicErrorResponse, "serialization"),
]

_WHY = {
    "400": "a field is invalid or not supported, or the request cannot be served (e.g. "
           "longer than the context)",
    "401": "the API key is missing or wrong (when the server requires one); OpenAI's error "
           "shape",
    "404": "the `model` is not served, or no message batch has that id (or `after_id`, "
           "`before_id`)",
    "413": "the body is larger than the server's limit",
    "415": "the Content-Type is not JSON",
    "429": "the server is at capacity; retry after `Retry-After` seconds",
    "500": "an internal error",
    "503": "the engine replica serving the request or the scheduler failed mid-request "
           "(retry); for batches, the Ray Jobs API (the dashboard) is out of reach",
}

_MESSAGE: dict[str, Any] = {
    "type": "object",
    "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
    "properties": {
        "id": {"type": "string"}, "type": {"const": "message"},
        "role": {"const": "assistant"}, "model": {"type": "string"},
        "content": {"type": "array", "items": {"type": "object"}},
        "stop_reason": {"type": "string"}, "stop_sequence": {"type": ["string", "null"]},
        "usage": {"type": "object"},
    },
}
_COUNT: dict[str, Any] = {"type": "object", "required": ["input_tokens"],
                          "properties": {"input_tokens": {"type": "integer"}}}
_EVENT: dict[str, Any] = {"type": "object", "required": ["event", "data"],
                          "properties": {"event": {"type": "string"},
                                         "data": {"type": "string"}}}


_BATCH: dict[str, Any] = {
    "type": "object",
    "required": ["id", "type", "processing_status", "request_counts", "created_at"],
    "properties": {"id": {"type": "string"}, "type": {"const": "message_batch"},
                   "processing_status": {"enum": ["in_progress", "canceling", "ended"]},
                   "request_counts": {"type": "object"},
                   "created_at": {"type": "string"},
                   "results_url": {"type": ["string", "null"]}},
}
_DELETED: dict[str, Any] = {
    "type": "object", "required": ["id", "type"],
    "properties": {"id": {"type": "string"}, "type": {"const": "message_batch_deleted"}},
}
_BATCH_LIST: dict[str, Any] = {
    "type": "object", "required": ["data", "has_more"],
    "properties": {"data": {"type": "array", "items": _BATCH}, "has_more": {"type": "boolean"},
                   "first_id": {"type": ["string", "null"]},
                   "last_id": {"type": ["string", "null"]}},
}


def messages_paths(refs: dict[Any, dict[str, Any]], error_ref: dict[str, Any]
                   ) -> dict[str, Any]:
    anthropic_error = refs[(AnthropicErrorResponse, "serialization")]
    # The auth layer's 401 is OpenAI's; so is a 500 from an exception no
    # handler took (api/http.py's JSONServerErrors).
    shapes = {"401": error_ref, "500": {"oneOf": [anthropic_error, error_ref]}}

    def op(summary: str, body: Any, ok: dict[str, Any], errors: str,
           params: list[dict[str, Any]] | None = None,
           content: dict[str, Any] | None = None) -> dict[str, Any]:
        content = content or {"application/json": {"schema": ok}}
        if ok is _MESSAGE:
            content["text/event-stream"] = {"schema": _EVENT}
        out: dict[str, Any] = {
            "summary": summary, "parameters": params or [],
            "responses": {"200": {"description": "done", "content": content}, **{
                code: {"description": _WHY[code], "content": {"application/json": {
                    "schema": shapes.get(code, anthropic_error)}}}
                for code in errors.split()}}}
        if body is not None:
            out["requestBody"] = {"required": True,
                                  "content": {"application/json": {"schema": body}}}
        return out

    batch = [param("batch_id")]
    page = [param("limit", "query", type="integer", minimum=1, maximum=1000),
            param("after_id", "query"), param("before_id", "query")]
    jsonl = {"application/x-jsonl": {"schema": {"type": "string"}}}
    batches = {
        "/v1/messages/batches": {
            "post": op("Create a Message Batch (its Ray Job runs the requests offline)",
                       refs[(MessageBatchCreate, "validation")], _BATCH,
                       "400 401 413 415 500 503"),
            "get": op("Message Batches, newest first", None, _BATCH_LIST, "400 401 404 500 503",
                      page)},
        "/v1/messages/batches/{batch_id}": {
            "get": op("A Message Batch", None, _BATCH, "401 404 500 503", batch),
            "delete": op("Delete an ended Message Batch, its files too", None, _DELETED,
                         "400 401 404 500 503", batch)},
        "/v1/messages/batches/{batch_id}/cancel": {"post": op(
            "Cancel a Message Batch", None, _BATCH, "400 401 404 500 503", batch)},
        "/v1/messages/batches/{batch_id}/results": {"get": op(
            "A Message Batch's results, one JSON line per request, once it ended", None,
            _BATCH, "400 401 404 500 503", batch, jsonl)},
    }

    return {
        "/v1/messages": {"post": op(
            "Anthropic's Messages API: a Message, or with `stream: true` its events",
            refs[(MessagesRequest, "validation")], _MESSAGE,
            "400 401 404 413 415 429 500 503")},
        "/v1/messages/count_tokens": {"post": op(
            "The input tokens of a Message's prompt", refs[(CountTokensRequest, "validation")],
            _COUNT, "400 401 404 413 415 500")},
        **batches,
    }
