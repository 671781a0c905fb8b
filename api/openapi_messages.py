"""The `/v1/messages` part of `GET /openapi.json` (api/openapi.py builds the
document; deployments/messages_route.py serves the routes).  Its errors
have Anthropic's shape (`AnthropicErrorResponse`), but a 401, which the
auth layer answers in OpenAI's."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from api.messages_api import AnthropicErrorResponse, CountTokensRequest, MessagesRequest

MODELS: list[tuple[type[BaseModel], Any]] = [
    (MessagesRequest, "validation"),
    (CountTokensRequest, "validation"),
    (AnthropicErrorResponse, "serialization"),
]

_WHY = {
    "400": "a field is invalid or not supported, or the request cannot be served (e.g. "
           "longer than the context)",
    "401": "the API key is missing or wrong (when the server requires one); OpenAI's error "
           "shape",
    "404": "the `model` is not served",
    "413": "the body is larger than the server's limit",
    "415": "the Content-Type is not JSON",
    "429": "the server is at capacity; retry after `Retry-After` seconds",
    "500": "an internal error",
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


def messages_paths(refs: dict[Any, dict[str, Any]], error_ref: dict[str, Any]
                   ) -> dict[str, Any]:
    anthropic_error = refs[(AnthropicErrorResponse, "serialization")]

    def op(summary: str, body: Any, ok: dict[str, Any], errors: str) -> dict[str, Any]:
        content: dict[str, Any] = {"application/json": {"schema": ok}}
        if ok is _MESSAGE:
            content["text/event-stream"] = {"schema": _EVENT}
        return {"summary": summary,
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": body}}},
                "responses": {"200": {"description": "done", "content": content}, **{
                    code: {"description": _WHY[code], "content": {"application/json": {
                        "schema": error_ref if code == "401" else anthropic_error}}}
                    for code in errors.split()}}}

    return {
        "/v1/messages": {"post": op(
            "Anthropic's Messages API: a Message, or with `stream: true` its events",
            refs[(MessagesRequest, "validation")], _MESSAGE,
            "400 401 404 413 415 429 500")},
        "/v1/messages/count_tokens": {"post": op(
            "The input tokens of a Message's prompt", refs[(CountTokensRequest, "validation")],
            _COUNT, "400 401 404 413 415 500")},
    }
