"""Errors a client can act on: an HTTP status and an OpenAI-style body."""

from __future__ import annotations

from pydantic import ValidationError

from app.protocol import ErrorBody, ErrorResponse

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 422: "invalid_request_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _TYPES.get(status, "server_error")

    def body(self) -> dict:
        return ErrorResponse(error=ErrorBody(
            message=self.message, type=self.type, param=self.param, code=self.status,
        )).model_dump()


def validation_error(e: ValidationError) -> APIError:
    """422 naming every offending field, e.g. `max_tokens: must be > 0`."""
    parts, first = [], None
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        first = first or loc
        parts.append(f"{loc}: {err['msg']}")
    return APIError(422, "; ".join(parts), first)
