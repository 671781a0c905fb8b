"""The `/v1/conversations` part of `GET /openapi.json` (api/openapi.py
builds the document; api/conversations_route.py serves the routes)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from api.conversations import ConversationCreate, ConversationUpdate, ItemsCreate

MODELS: list[tuple[type[BaseModel], Any]] = [
    (ConversationCreate, "validation"),
    (ConversationUpdate, "validation"),
    (ItemsCreate, "validation"),
]

_WHY = {
    "400": "a field or query parameter is invalid or not supported, or the server keeps "
           "no conversations (`responses.store: false`)",
    "401": "the API key is missing or wrong (when the server requires one)",
    "404": "no conversation of that id (never made, or deleted), no such item in it, or no "
           "item `after` names",
    "413": "the body is larger than the server's limit",
    "415": "the Content-Type is not JSON",
    "500": "an internal error",
}

_CONVERSATION: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "created_at", "metadata"],
    "properties": {"id": {"type": "string"}, "object": {"const": "conversation"},
                   "created_at": {"type": "integer"},
                   "metadata": {"type": "object", "additionalProperties": {"type": "string"}}},
}
_DELETED: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "deleted"],
    "properties": {"id": {"type": "string"}, "object": {"const": "conversation.deleted"},
                   "deleted": {"const": True}},
}
_ITEM: dict[str, Any] = {"type": "object", "required": ["id", "type"],
                         "properties": {"id": {"type": "string"}, "type": {"type": "string"}}}
_ITEM_LIST: dict[str, Any] = {
    "type": "object",
    "required": ["object", "data", "has_more"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ITEM},
                   "first_id": {"type": ["string", "null"]},
                   "last_id": {"type": ["string", "null"]}, "has_more": {"type": "boolean"}},
}


def param(name: str, where: str = "path", **schema: Any) -> dict[str, Any]:
    return {"name": name, "in": where, "required": where == "path",
            "schema": schema or {"type": "string"}}


def op(summary: str, ok: dict[str, Any], errors: str, error_ref: dict[str, Any],
       params: list[dict[str, Any]], body: dict[str, Any] | None = None,
       why: dict[str, str] = _WHY) -> dict[str, Any]:
    """An operation answering `ok` (its schema), and errors of the statuses
    `errors` names, each described by `why`."""
    out: dict[str, Any] = {
        "summary": summary,
        "parameters": params,
        "responses": {
            "200": {"description": "done", "content": {"application/json": {"schema": ok}}},
            **{code: {"description": why[code],
                      "content": {"application/json": {"schema": error_ref}}}
               for code in errors.split()},
        },
    }
    if body is not None:
        out["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return out


def conversations_paths(refs: dict[Any, dict[str, Any]], error_ref: dict[str, Any]
                        ) -> dict[str, Any]:
    conv = [param("conversation_id")]
    item = [*conv, param("item_id")]
    page = [param("limit", "query", type="integer", minimum=1, maximum=100),
            param("order", "query", type="string", enum=["asc", "desc"]),
            param("after", "query")]
    body_errors = "400 401 404 413 415 500"
    return {
        "/v1/conversations": {"post": op(
            "Create a conversation (up to 20 items, metadata)", _CONVERSATION,
            "400 401 413 415 500", error_ref, [],
            refs[(ConversationCreate, "validation")])},
        "/v1/conversations/{conversation_id}": {
            "get": op("A conversation", _CONVERSATION, "400 401 404 500", error_ref, conv),
            "post": op("Replace a conversation's metadata", _CONVERSATION, body_errors,
                        error_ref, conv, refs[(ConversationUpdate, "validation")]),
            "delete": op("Delete a conversation and its items", _DELETED, "400 401 404 500",
                          error_ref, conv),
        },
        "/v1/conversations/{conversation_id}/items": {
            "get": op("A conversation's items (newest first unless `order` is asc)",
                       _ITEM_LIST, "400 401 404 500", error_ref, [*conv, *page]),
            "post": op("Add up to 20 items to a conversation", _ITEM_LIST, body_errors,
                        error_ref, conv, refs[(ItemsCreate, "validation")]),
        },
        "/v1/conversations/{conversation_id}/items/{item_id}": {
            "get": op("One item of a conversation", _ITEM, "400 401 404 500", error_ref,
                       item),
            "delete": op("Delete an item; the conversation", _CONVERSATION,
                          "400 401 404 500", error_ref, item),
        },
    }
