"""One POST operation of `GET /openapi.json` with a JSON body, its answer
and its error statuses: the shape the smaller route groups share."""

from __future__ import annotations

from typing import Any


def post_op(summary: str, body: dict[str, Any], ok: dict[str, Any],
            errors: dict[str, str], error_ref: dict[str, Any],
            media_type: str = "application/json") -> dict[str, Any]:
    """`ok`: the 200 answer's schema, sent as `media_type`."""
    return {"summary": summary,
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": {"description": summary, "content": {media_type: {"schema": ok}}},
                **{code: {"description": why,
                          "content": {"application/json": {"schema": error_ref}}}
                   for code, why in errors.items()}}}
