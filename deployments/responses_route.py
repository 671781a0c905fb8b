"""`POST /v1/responses`: the Responses API on the ingress's chat path.

The request is validated as a Responses request, served as the chat
completion it amounts to (`api/responses_api.py`: admission, the engine
stream, tools and structured output as for chat), and answered as a
Response object or its semantic events (`api/responses_stream.py`).  An
error about a chat field is reported under the Responses field it came
from.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from api.errors import APIError, validation_error
from api.responses_api import (
    ResponsesRequest,
    new_response_id,
    now,
    output_of,
    param_of,
    response_object,
    sse,
    usage_of,
)
from api.responses_stream import ResponseEvents


class ResponsesRoute:
    def __init__(self, ingress: Any) -> None:
        self.ingress = ingress

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        ing = self.ingress
        req = await ing.parse_body(request, ResponsesRequest)
        req = req.model_copy(update={"model": ing.cfg.model_name})
        try:
            chat = req.chat()
        except ValidationError as e:
            raise _as_responses(validation_error(e)) from None
        try:
            async with ing.door.start(False, 0):
                builder, stream = await ing.start_chat(chat)
        except APIError as e:
            raise _as_responses(e) from None
        response_id, created = new_response_id(), now()
        if req.stream:
            return StreamingResponse(self._events(req, builder, stream, response_id, created),
                                     media_type="text/event-stream")
        out = await ing.collect(builder, stream)
        output, status = output_of(out)
        return JSONResponse(response_object(req, response_id, created, status, output,
                                            usage_of(out["usage"])))

    async def _events(self, req: ResponsesRequest, builder: Any, stream: Any,
                      response_id: str, created: float) -> AsyncIterator[str]:
        events = ResponseEvents(req, response_id, created)
        for e in events.opening():
            yield sse(e)
        async with aclosing(self.ingress.chunks(builder, stream)) as chunks:
            async for chunk in chunks:
                if "error" in chunk:  # the answer failed after its start
                    for e in events.failed(chunk):
                        yield sse(e)
                    return
                for e in events.feed(chunk):
                    yield sse(e)
        for e in events.closing(builder.usage()):
            yield sse(e)


# Chat's names in an error's message, and the Responses fields they stand for.
_NAMES = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
          ("response_format", "text.format"), ("messages", "input"))


def _as_responses(e: APIError) -> APIError:
    message = e.message
    for chat, ours in _NAMES:
        message = message.replace(chat, ours)
    return APIError(e.status, message, param_of(e.param), e.type, e.headers)
