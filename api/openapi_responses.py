"""The stored responses' part of `GET /openapi.json` (api/openapi.py builds
the document; deployments/responses_route.py serves the routes)."""

from __future__ import annotations

from typing import Any

_WHY = {
    "400": "a query parameter is invalid or not supported, or the response was not made "
           "in the background (cancel), or not streamed there (stream)",
    "401": "the API key is missing or wrong (when the server requires one)",
    "404": "no stored response of that id (never stored, deleted or expired), or no "
           "input item `after` names",
    "500": "an internal error",
}

_ITEM_LIST: dict[str, Any] = {
    "type": "object",
    "required": ["object", "data", "has_more"],
    "properties": {"object": {"const": "list"},
                   "data": {"type": "array", "items": {"type": "object"}},
                   "first_id": {"type": ["string", "null"]},
                   "last_id": {"type": ["string", "null"]},
                   "has_more": {"type": "boolean"}},
}

_DELETED: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "deleted"],
    "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                   "deleted": {"const": True}},
}


# One server-sent event of a streamed Response (`event:` and `data:` lines).
_EVENT: dict[str, Any] = {"type": "object", "required": ["event", "data"],
                          "properties": {"event": {"type": "string"},
                                         "data": {"type": "string"}}}


def _op(summary: str, ok: dict[str, Any], errors: str, error_ref: dict[str, Any],
        query: list[dict[str, Any]] | None = None, events: bool = False) -> dict[str, Any]:
    params = [{"name": "response_id", "in": "path", "required": True,
               "schema": {"type": "string"}}, *(query or [])]
    content: dict[str, Any] = {"application/json": {"schema": ok}}
    if events:
        content["text/event-stream"] = {"schema": _EVENT}
    return {
        "summary": summary,
        "parameters": params,
        "responses": {
            "200": {"description": "found", "content": content},
            **{code: {"description": _WHY[code],
                      "content": {"application/json": {"schema": error_ref}}}
               for code in errors.split()},
        },
    }


def responses_paths(error_ref: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    page = [{"name": "limit", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
            {"name": "order", "in": "query", "required": False,
             "schema": {"type": "string", "enum": ["asc", "desc"]}},
            {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}}]
    return {
        "/v1/responses/{response_id}": {
            "get": _op("A stored Response; with `stream=true`, a streamed background "
                       "Response's events (after `starting_after`), to its last", response,
                       "400 401 404 500", error_ref, [
                           {"name": "stream", "in": "query", "required": False,
                            "schema": {"type": "boolean"}},
                           {"name": "starting_after", "in": "query", "required": False,
                            "schema": {"type": "integer", "minimum": -1}}], events=True),
            "delete": _op("Delete a stored Response", _DELETED, "401 404 500", error_ref),
        },
        "/v1/responses/{response_id}/cancel": {"post": _op(
            "Cancel a background Response (it says `cancelled` once stopped; one that had "
            "ended is returned as it is)", response, "400 401 404 500", error_ref)},
        "/v1/responses/{response_id}/input_items": {"get": _op(
            "A stored Response's own input items (newest first unless `order` is asc)",
            _ITEM_LIST, "400 401 404 500", error_ref, page)},
    }
