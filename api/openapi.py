"""`GET /openapi.json`: an OpenAPI 3.1 description of the served API.

The request bodies are the JSON Schemas of the protocol's pydantic models,
generated when the ingress starts, so a field added to `api/protocol.py`
appears here with no edit.  Every 4xx/5xx is described by `ErrorResponse`,
but for the Anthropic routes' own errors (`api/openapi_messages.py`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api.openapi_batch import MODELS as BATCH_MODELS
from api.openapi_batch import batch_paths
from api.openapi_chat_store import MODELS as CHAT_STORE_MODELS
from api.openapi_chat_store import chat_store_paths
from api.openapi_conversations import MODELS as CONVERSATION_MODELS
from api.openapi_conversations import conversations_paths
from api.lora_runtime import MODELS as LORA_MODELS
from api.lora_runtime import lora_paths
from api.openapi_messages import MODELS as MESSAGES_MODELS
from api.openapi_messages import messages_paths
from api.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from api.openapi_responses import responses_paths
from api.responses_api import ResponsesRequest
from api.tokenize_route import MODELS as TOKENIZE_MODELS
from api.tokenize_route import tokenize_paths

_REF = "#/components/schemas/{model}"

# Statuses each kind of operation may answer with an error body.
_POST_ERRORS = {
    "400": "the body is not a JSON object, a field is invalid or out of range, "
           "or the request cannot be served (e.g. longer than the context)",
    "401": "the API key is missing or wrong (when the server requires one)",
    "404": "the `model` is not served (or, for a Response, no stored response has the "
           "`previous_response_id`, or no conversation the `conversation` id)",
    "413": "the body is larger than the server's limit",
    "415": "the Content-Type is not JSON",
    "429": "the server is at capacity; retry after `Retry-After` seconds",
    "500": "an internal error",
    "503": "the engine replica serving the request failed or shut down mid-request, or the "
           "scheduler failed while the request waited for it; retry",
}
_GET_ERRORS = {
    "401": _POST_ERRORS["401"],
    "500": _POST_ERRORS["500"],
}

_COMPLETION_RESPONSE: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "usage": {"type": ["object", "null"]},
    },
}

_RESPONSE: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "created_at", "status", "model", "output"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "response"},
        "created_at": {"type": "integer"}, "status": {"type": "string"},
        "model": {"type": "string"}, "output": {"type": "array", "items": {"type": "object"}},
        "usage": {"type": ["object", "null"]},
    },
}

# One server-sent event: `data` is a JSON chunk (or an error body); chat and
# completions streams end with the literal `[DONE]`, Responses streams
# with their last event.
_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}

_MODEL: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                   "created": {"type": "integer"}, "owned_by": {"type": "string"},
                   "max_model_len": {"type": "integer"}},
}

_MODEL_LIST: dict[str, Any] = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {"type": "array", "items": _MODEL},
    },
}


def _version() -> str:
    try:
        return metadata.version("preempt-serve")
    except metadata.PackageNotFoundError:
        return "0"


def _errors(statuses: dict[str, str], error_ref: dict[str, Any]) -> dict[str, Any]:
    return {code: {"description": why, "content": {"application/json": {"schema": error_ref}}}
            for code, why in statuses.items()}


def _completion_op(summary: str, request_ref: dict[str, Any], error_ref: dict[str, Any],
                   answer: dict[str, Any] = _COMPLETION_RESPONSE) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": request_ref}}},
        "responses": {
            "200": {
                "description": "the completion, or with `stream: true` its server-sent events",
                "content": {"application/json": {"schema": answer},
                            "text/event-stream": {"schema": _EVENT}},
            },
            **_errors(_POST_ERRORS, error_ref),
        },
    }


def build_openapi(title: str = "preempt-serve", auth: bool = False,
                  lora_runtime: bool = False) -> dict[str, Any]:
    """The document; `auth` marks every operation but /health as needing
    the bearer key; `lora_runtime` adds the runtime LoRA routes (served only
    then)."""
    models: list[tuple[type[BaseModel], Any]] = [
        (CompletionRequest, "validation"),
        (ChatCompletionRequest, "validation"),
        (ResponsesRequest, "validation"),
        (ErrorResponse, "serialization"),
        *BATCH_MODELS,
        *TOKENIZE_MODELS,
        *CONVERSATION_MODELS,
        *CHAT_STORE_MODELS,
        *MESSAGES_MODELS,
        *(LORA_MODELS if lora_runtime else []),
    ]
    refs, top = models_json_schema(models, ref_template=_REF)
    completion_ref = refs[(CompletionRequest, "validation")]
    chat_ref = refs[(ChatCompletionRequest, "validation")]
    error_ref = refs[(ErrorResponse, "serialization")]
    stored_list, stored_paths = chat_store_paths(refs, error_ref, _COMPLETION_RESPONSE)
    paths: dict[str, Any] = {
        "/v1/models": {"get": {
            "summary": "The served model (with an `anthropic-version` header, in Anthropic's "
                       "shape: `type: model`, `display_name`, `created_at`, `has_more`)",
            "responses": {
                "200": {"description": "the model list",
                        "content": {"application/json": {"schema": _MODEL_LIST}}},
                **_errors(_GET_ERRORS, error_ref),
            },
        }},
        "/v1/models/{model}": {"get": {
            "summary": "The served model, by id",
            "parameters": [{"name": "model", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "responses": {
                "200": {"description": "the model",
                        "content": {"application/json": {"schema": _MODEL}}},
                **_errors({**_GET_ERRORS, "404": "no model of that id is served"}, error_ref),
            },
        }},
        "/v1/completions": {"post": _completion_op("Text completion", completion_ref, error_ref)},
        "/v1/chat/completions": {"post": _completion_op(
            "Chat completion (kept for the routes below with `store: true`)", chat_ref,
            error_ref), **stored_list},
        **stored_paths,
        "/v1/responses": {"post": _completion_op(
            "A Response, served as a chat completion (stored as `store` says, by default as "
            "the server's `responses.store`; `previous_response_id` continues a stored one, "
            "404 where none is stored, 400 where the server stores none)",
            refs[(ResponsesRequest, "validation")], error_ref, _RESPONSE)},
        **responses_paths(error_ref, _RESPONSE),
        **conversations_paths(refs, error_ref),
        **messages_paths(refs, error_ref),
        "/health": {"get": {
            "summary": "Readiness: 200 once an engine replica serves, 503 while none does "
                       "(never needs a key)",
            "security": [],
            "responses": {"200": {"description": "serving"},
                          "500": _errors(_GET_ERRORS, error_ref)["500"],
                          **_errors({"503": "no engine replica serves yet (or the scheduler "
                                            "does not answer); retry"}, error_ref)},
        }},
        **batch_paths(refs, error_ref),
        **tokenize_paths(refs, error_ref),
        **(lora_paths(refs, error_ref) if lora_runtime else {}),
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": _version(),
                 "description": "OpenAI-compatible completions, chat, Responses, "
                                "conversations, batches and tokenization, and Anthropic's "
                                "Messages API, served by preempt-serve."},
        "paths": paths,
        "components": {"schemas": top.get("$defs", {})},
    }
    if auth:
        # The key in either header: OpenAI's clients send a bearer token,
        # Anthropic's an `x-api-key` (api/auth.py).
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
        doc["security"] = [{"bearer": []}, {"x-api-key": []}]
    return doc


def openapi_endpoint(doc: dict[str, Any]) -> Callable[[Request], Awaitable[Response]]:
    """A route endpoint serving `doc`, rendered once."""
    body = JSONResponse(doc).body

    async def openapi_json(request: Request) -> Response:
        return Response(body, media_type="application/json")

    return openapi_json
