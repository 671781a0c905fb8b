"""HTTP hardening of the ingress: bounded body reading, strict JSON, and
handlers that turn every failure into an OpenAI-style JSON error.

No input may produce a 5xx or a body that is not JSON.  Each way a body can
be wrong gets its own 4xx here, before the request models see it:

- larger than the limit: 413, from Content-Length before reading and from
  the byte count while a chunked body arrives, so it is never buffered whole;
- a content type other than JSON: 415 (a missing one is read as JSON, as
  vLLM and FastAPI do);
- invalid UTF-8, NaN / Infinity literals, numbers that overflow a float,
  nesting deeper than `MAX_JSON_DEPTH`, not an object: 400;
- lone surrogates (`"\\ud800"`) anywhere: 400 naming the field, since the
  tokenizer's Rust side cannot take them and the response could not be
  encoded either.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any, NoReturn, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import APIError, validation_error

M = TypeVar("M", bound=BaseModel)

log = logging.getLogger("ray.serve")

# Far above any real request (a chat message list is 3 to 4 levels deep) and
# far below the interpreter's recursion limit, which json and pydantic hit.
MAX_JSON_DEPTH = 64

_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_KINDS: dict[type, str] = {
    list: "an array", str: "a string", int: "a number", float: "a number",
    bool: "a boolean", type(None): "null",
}


def is_json_media_type(content_type: str) -> bool:
    """application/json or any */*+json, whatever its parameters."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json":
        return True
    kind, _, subtype = media.partition("/")
    return bool(kind) and subtype.endswith("+json") and len(subtype) > len("+json")


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} does not fit a 64-bit float")
    return value


def _dotted(path: tuple[str | int, ...]) -> str:
    # Capped: a key may be as long as the body.
    return ".".join(str(p) for p in path)[:200]


def check_json_tree(data: Any) -> None:
    """Reject nesting deeper than `MAX_JSON_DEPTH` and strings (values or
    keys) holding lone surrogates, naming where.  Iterative: it must not
    recurse on the very input it guards against."""
    stack: list[tuple[Any, tuple[str | int, ...], int]] = [(data, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            # `param`: the top-level field; the full path would be as deep.
            raise APIError(400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels",
                           _dotted(path[:1]) or None)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            where = path + (key,)
            if isinstance(key, str) and _SURROGATE.search(key):
                raise APIError(400, "a field name holds a lone UTF-16 surrogate, "
                               "which is not a Unicode character", _dotted(path) or None)
            if isinstance(item, str):
                if _SURROGATE.search(item):
                    raise APIError(400, f"{_dotted(where)}: the string holds a lone UTF-16 "
                                   "surrogate, which is not a Unicode character",
                                   _dotted(where))
            elif isinstance(item, (dict, list)):
                stack.append((item, where, depth + 1))


async def read_model(request: Request, model: type[M], max_bytes: int) -> M:
    """The body, read as `read_json_object` reads it, validated as `model`
    (a 400 naming the fields otherwise)."""
    data = await read_json_object(request, max_bytes)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or an `APIError` 400 saying what is wrong."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})")
    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise APIError(400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels")
    except ValueError as e:  # JSONDecodeError, rejected constants, huge numbers
        raise APIError(400, f"the request body is not valid JSON: {e}")
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object, not "
                       f"{_JSON_KINDS.get(type(data), 'a JSON value')}")
    check_json_tree(data)
    return data


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None:
        declared = declared.strip()
        if not (declared.isascii() and declared.isdigit()):
            raise APIError(400, "the Content-Length header is not a number")
        if int(declared) > max_bytes:
            raise APIError(413, f"the request body is {int(declared)} bytes; "
                           f"the limit is {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:  # a chunked body: stop before buffering it all
                raise APIError(413, f"the request body exceeds the limit of {max_bytes} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected before sending the whole body")
    return b"".join(chunks)


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The checks every JSON endpoint makes, in order: type, size, syntax;
    the first two before a byte of the body is read."""
    content_type = request.headers.get("content-type", "").strip()
    if content_type and not is_json_media_type(content_type):
        raise APIError(415, f"unsupported Content-Type {content_type[:100]!r}; "
                       "send application/json")
    return parse_json_object(await read_body(request, max_bytes))


# Handlers -------------------------------------------------------------------


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no route) and 405 (route without the method), as
    JSON; the 405 keeps its `Allow` header."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.url.path[:200]!r}"
    elif exc.status_code == 405:
        message = (f"method {request.method[:20]} is not allowed on "
                   f"{request.url.path[:200]!r}")
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message, headers=exc.headers).response()


class JSONServerErrors:
    """Outermost middleware: an exception no handler took becomes a JSON
    500 (never Starlette's plain-text one), logged with its traceback.

    Unlike Starlette's ServerErrorMiddleware it does not re-raise once it has
    answered, so the server does not log or answer the failure a second time.
    If the response had already started (a stream), nothing valid can be
    sent any more: the exception propagates and the server drops the
    connection.

    `disconnected`: exceptions that only say the client went away (Ray
    Serve cancels a request's task when its HTTP client disconnects, and a
    stream's wait for `http.disconnect` then raises `TaskCancelledError`
    instead): logged as a disconnect, without a traceback, and nothing is
    sent.
    """

    def __init__(self, app: ASGIApp,
                 disconnected: tuple[type[Exception], ...] = ()) -> None:
        self.app = app
        self.disconnected = disconnected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except self.disconnected:
            log.info("client disconnected during %s %s", scope.get("method"), scope.get("path"))
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            response = APIError(500, "internal server error").response()
            await response(scope, receive, send)
