"""`/v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API
on the ingress's chat path (api/messages_api.py, api/messages_stream.py).

A request is validated as Anthropic's, then as the chat completion it
amounts to (admission, the engine stream, tools and structured tool calls,
LoRA adapters by `model`, as for chat), and answered as a Message or its
events.  Errors have Anthropic's shape, but for a missing or wrong API key
(the auth layer's, OpenAI's shape: the status is what clients read).
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
from api.messages_api import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_errors,
    check_tools,
    error_body,
    message_object,
    messages_error,
    new_message_id,
)
from api.messages_stream import MessageEvents
from api.protocol import ChatCompletionRequest
from api.tokenize_route import chat_ids


class MessagesRoute:
    def __init__(self, ingress: Any) -> None:
        self.ingress = ingress

    def routes(self) -> list[Route]:
        return [Route("/v1/messages", anthropic_errors(self.create), methods=["POST"]),
                Route("/v1/messages/count_tokens", anthropic_errors(self.count_tokens),
                      methods=["POST"])]

    async def create(self, request: Request) -> Response:
        req = await self.ingress.parse_body(request, MessagesRequest)
        builder, stream = await self._start(req)
        message_id = new_message_id()
        if req.stream:
            return StreamingResponse(self._events(req, builder, stream, message_id),
                                     media_type="text/event-stream")
        answer = await self.ingress.collect(builder, stream)
        return JSONResponse(message_object(message_id, req.model, answer, req.thinks))

    async def batch_message(self, body: dict[str, Any]) -> dict[str, Any]:
        """One `/v1/messages` line of a batch: the Message, served whole as
        offline work (deployments/batch_request.py)."""
        req = self.ingress.validate(body, MessagesRequest)
        if req.stream:
            raise APIError(400, "a batch request cannot be streamed", "stream")
        builder, stream = await self._start(req, offline=True)
        answer = await self.ingress.collect(builder, stream)
        return message_object(new_message_id(), req.model, answer, req.thinks)

    async def count_tokens(self, request: Request) -> Response:
        ing = self.ingress
        counted = await ing.parse_body(request, CountTokensRequest)
        # `thinking` changes the answer, not the prompt.
        chat = self._chat(ing.validate(
            {**counted.model_dump(exclude_none=True, exclude={"thinking"}), "max_tokens": 1},
            MessagesRequest))
        try:
            _, _, ids = chat_ids(chat, ing.tokenizer, ing.tool_format)
        except APIError as e:
            raise messages_error(e) from None
        return JSONResponse({"input_tokens": len(ids)})

    async def _start(self, req: MessagesRequest, offline: bool = False) -> tuple[Any, Any]:
        """Admit `req` as the chat request it amounts to; its builder and
        engine stream."""
        chat = self._chat(req)
        if offline:
            chat = chat.model_copy(update={"job_class": "offline"})
        # A reasoning model's reasoning is apart from its answer: a thinking
        # block when asked for, else not shown (reasoning_parser).
        if req.thinks and self.ingress.cfg.reasoning_parser == "none":
            raise APIError(400, "thinking: this server's model does not reason "
                           "(reasoning_parser is none)", "thinking")
        try:
            async with self.ingress.door.start(offline, chat.priority):
                return await self.ingress.start_chat(chat)
        except APIError as e:
            raise messages_error(e) from None

    def _chat(self, req: MessagesRequest) -> ChatCompletionRequest:
        """The chat request `req` amounts to; its refusals name Anthropic's
        fields."""
        check_tools(req)
        try:
            return ChatCompletionRequest.model_validate(req.chat_body())
        except ValidationError as e:
            raise messages_error(validation_error(e)) from None

    async def _events(self, req: MessagesRequest, builder: Any, stream: Any,
                      message_id: str) -> AsyncIterator[str]:
        prompt = sum(len(p.token_ids) for p in builder.prompts)
        events = MessageEvents(message_id, req.model, prompt, req.thinks)
        for e in events.opening():
            yield e
        async with aclosing(self.ingress.chunks(builder, stream, True)) as chunks:
            async for chunk in chunks:
                if "error" in chunk:  # the answer failed after its start
                    err = chunk["error"]
                    for e in events.failed(error_body(APIError(err["code"], err["message"]))):
                        yield e
                    return
                for e in events.feed(chunk):
                    yield e
        for e in events.closing():
            yield e

