"""Reading a batch input file: each line becomes a request to send or the
reason it cannot be sent.

A line is checked as the HTTP routes check a body (api/http.py: strict
UTF-8 JSON, no NaN, bounded nesting, no lone surrogates), then against
OpenAI's line shape (`custom_id`, `method: POST`, `url`, `body`).  What the
body holds is left to the ingress, which validates it exactly as the route
would.  A `custom_id` that names more than one line is refused on each of
them: results are matched to requests, and a batch resumed, by it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from api.batch import BATCH_ENDPOINTS, BatchError, BatchInputLine
from api.errors import APIError, validation_error
from api.http import parse_json_object


@dataclass(frozen=True)
class Request:
    """A line to send: `body` to `url`."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Rejected:
    """A line that is never sent, and why."""

    line: int
    custom_id: str | None
    error: BatchError


Item = Request | Rejected


def _numbered(data: bytes) -> Iterable[tuple[int, bytes]]:
    """Non-blank lines with their numbers from 1; blank lines (a trailing
    newline, spacing) are no requests."""
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if raw.strip():
            yield number, raw.rstrip(b"\r")


def _parse_line(number: int, raw: bytes, endpoint: str | None) -> Item:
    try:
        obj = parse_json_object(raw)
    except APIError as e:
        return Rejected(number, None, BatchError(code="invalid_json", message=e.message,
                                                 line=number, param=e.param))
    custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
    try:
        parsed = BatchInputLine.model_validate(obj)
    except ValidationError as e:
        err = validation_error(e)
        return Rejected(number, custom_id, BatchError(code="invalid_request", message=err.message,
                                                      line=number, param=err.param))
    if endpoint is not None and parsed.url != endpoint:
        return Rejected(number, custom_id, BatchError(
            code="invalid_url", line=number, param="url",
            message=f"url {parsed.url!r} differs from the batch's endpoint {endpoint!r}"))
    return Request(number, parsed.custom_id, parsed.url, parsed.body)


def parse_batch(data: bytes, endpoint: str | None = None) -> list[Item]:
    """Every non-blank line of an input file, in order.  `endpoint`: the
    url every line must name (a batch targets one endpoint, as OpenAI's
    do); None takes either."""
    items = [_parse_line(n, raw, endpoint) for n, raw in _numbered(data)]
    seen = Counter(i.custom_id for i in items if i.custom_id is not None)
    return [Rejected(i.line, i.custom_id, BatchError(
                code="duplicate_custom_id", line=i.line, param="custom_id",
                message=f"custom_id {i.custom_id!r} names {seen[i.custom_id]} lines; "
                        "each line needs its own"))
            if isinstance(i, Request) and seen[i.custom_id] > 1 else i
            for i in items]


def count_lines(data: bytes) -> int:
    """The requests a file holds: its non-blank lines."""
    return sum(1 for _ in _numbered(data))


def first_endpoint(data: bytes) -> str:
    """The url of the first line that names a served endpoint: the
    endpoint of a batch submitted without one (OpenAI's batches have one;
    lines naming another are then refused)."""
    for item in (_parse_line(n, raw, None) for n, raw in _numbered(data)):
        if isinstance(item, Request):
            return item.url
    return BATCH_ENDPOINTS[0]
