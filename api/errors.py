"""Errors a client can act on: an HTTP status and an OpenAI-style body."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from starlette.responses import Response

from api.protocol import ErrorBody, ErrorResponse

# OpenAI's `type` for each status; anything unlisted at 5xx is a server error.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


# Validation errors listed in one message at most.
_MAX_LISTED = 20


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error")
        # e.g. `Allow` on a 405, `Retry-After` on a 429, `WWW-Authenticate` on a 401.
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorBody(
            message=self.message, type=self.type, param=self.param, code=self.status,
        )).model_dump()

    def response(self) -> Response:
        # ASCII-escaped: a message or param quoting client input (a path, a
        # field name) may hold lone surrogates, which cannot be UTF-8 encoded.
        content = json.dumps(self.body(), ensure_ascii=True).encode("ascii")
        return Response(content, status_code=self.status, headers=self.headers,
                        media_type="application/json")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "constrained-str"}


class PartError(ValueError):
    """A validator's error about one part of the field it checks (the
    conversation's `messages.2`, not all of `messages`): `validation_error`
    names the part."""

    def __init__(self, part: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.part = part


def validation_error(e: ValidationError) -> APIError:
    """400 naming every offending field, e.g. `max_tokens: must be > 0`.

    400 rather than 422: OpenAI and vLLM answer 400, and OpenAI's client
    maps 400 (not 422) to `BadRequestError`."""
    errors = e.errors(include_url=False, include_input=False)
    parts = [f"{_field(_loc(err))}: {_message(err)}" for err in errors[:_MAX_LISTED]]
    if len(errors) > _MAX_LISTED:  # e.g. every id of a 100k-token prompt
        parts.append(f"and {len(errors) - _MAX_LISTED} more")
    first = _field(_loc(errors[0])) if errors else None
    return APIError(400, "; ".join(parts), first)


def _loc(err: Any) -> tuple[Any, ...]:
    part = getattr(err.get("ctx", {}).get("error"), "part", ())
    return (*err["loc"], *part)


def _field(loc: tuple[Any, ...]) -> str:
    """`messages.0.content`, without the union-member tags pydantic puts in
    a location (`str`, `list[int]`, `function-after[...]`, and the bracketed
    tags of our discriminated unions, `[message]`)."""
    names = [str(p) for p in loc
             if isinstance(p, int) or not (p in _TYPE_TAGS or "[" in p)]
    return ".".join(names) or "body"


def _message(err: Any) -> str:
    if err["type"] == "extra_forbidden":
        return "unrecognized request argument"
    return str(err["msg"]).removeprefix("Value error, ")
