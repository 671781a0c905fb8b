"""The stored chat completions' part of `GET /openapi.json` (api/openapi.py
builds the document; api/chat_store_route.py serves the routes)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from api.chat_store_api import ChatCompletionUpdate
from api.openapi_conversations import op, param

MODELS: list[tuple[type[BaseModel], Any]] = [(ChatCompletionUpdate, "validation")]

_WHY = {
    "400": "a field or query parameter is invalid or not supported, or the server keeps "
           "no chat completions (`responses.store: false`)",
    "401": "the API key is missing or wrong (when the server requires one)",
    "404": "no stored chat completion of that id (never stored, deleted or expired), or "
           "none of the id `after` names",
    "413": "the body is larger than the server's limit",
    "415": "the Content-Type is not JSON",
    "500": "an internal error",
}

_DELETED: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "deleted"],
    "properties": {"id": {"type": "string"}, "object": {"const": "chat.completion.deleted"},
                   "deleted": {"const": True}},
}
_MESSAGE: dict[str, Any] = {
    "type": "object", "required": ["id", "role", "content"],
    "properties": {"id": {"type": "string"}, "role": {"type": "string"},
                   "content": {"type": ["string", "null"]},
                   "name": {"type": ["string", "null"]},
                   "content_parts": {"type": ["array", "null"], "items": {"type": "object"}}},
}


def _list(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["object", "data", "has_more"],
            "properties": {"object": {"const": "list"},
                           "data": {"type": "array", "items": item},
                           "first_id": {"type": ["string", "null"]},
                           "last_id": {"type": ["string", "null"]},
                           "has_more": {"type": "boolean"}}}


def chat_store_paths(refs: dict[Any, dict[str, Any]], error_ref: dict[str, Any],
                     completion: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The `get` operation of `/v1/chat/completions` (its `post` is the
    chat route's), and the paths under it."""
    one = [param("completion_id")]
    page = [param("limit", "query", type="integer", minimum=1, maximum=100),
            param("order", "query", type="string", enum=["asc", "desc"]),
            param("after", "query")]
    metadata = {"name": "metadata", "in": "query", "required": False, "style": "deepObject",
                "explode": True,
                "schema": {"type": "object", "additionalProperties": {"type": "string"}}}
    listing = op("Stored chat completions, oldest first unless `order` is desc (filtered by "
                 "`model` and `metadata[key]=value`)", _list(completion), "400 401 404 500",
                 error_ref, [param("model", "query"), metadata, *page], why=_WHY)
    return {"get": listing}, {
        "/v1/chat/completions/{completion_id}": {
            "get": op("A stored chat completion", completion, "400 401 404 500", error_ref,
                      one, why=_WHY),
            "post": op("Replace a stored chat completion's metadata", completion,
                       "400 401 404 413 415 500", error_ref, one,
                       refs[(ChatCompletionUpdate, "validation")], why=_WHY),
            "delete": op("Delete a stored chat completion", _DELETED, "400 401 404 500",
                         error_ref, one, why=_WHY),
        },
        "/v1/chat/completions/{completion_id}/messages": {"get": op(
            "The messages a stored chat completion answered (oldest first unless `order` "
            "is desc)", _list(_MESSAGE), "400 401 404 500", error_ref, [*one, *page],
            why=_WHY)},
    }
