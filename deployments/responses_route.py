"""`/v1/responses`: the Responses API on the ingress's chat path.

`POST`: the request is validated as a Responses request, served as the
chat completion it amounts to after the stored conversation it continues
(`previous_response_id`; `api/responses_api.py`: admission, the engine
stream, tools and structured output as for chat), and answered as a
Response object or its semantic events (`api/responses_stream.py`).  An
error about a chat field is reported under the Responses field it came
from.  A response is stored (`api/responses_store.py`) before its last
event or its body is sent, so a follow-up the client sends on reading it
finds it.  `GET /v1/responses/{id}`, `GET .../input_items` and `DELETE`
read and remove stored ones; `background: true` ones are run apart and
polled (`deployments/responses_background.py`), and `POST .../cancel`
stops them.  A request naming a `conversation` (api/conversations_route.py
serves those) reads its items as context, and its input and answer are
added to it before the answer is sent.  A batch's `/v1/responses` lines
come through `batch_response`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from api.conversation_store import ConversationStore
from api.conversations_route import ConversationsRoute
from api.errors import APIError, validation_error
from api.pages import list_object, page_after
from api.reasoning import check_reasoning
from api.responses_api import (
    ResponsesRequest,
    items_of,
    new_response_id,
    now,
    output_of,
    response_object,
    sse,
    usage_of,
)
from api.responses_errors import responses_error
from api.responses_store import ResponseStore, StoredResponse
from api.responses_stream import ResponseEvents
from api.responses_truncation import fit
from api.structured import requested_structure
from api.tokenize_route import chat_ids
from deployments.responses_background import OPEN, BackgroundResponses, Ending

log = logging.getLogger("ray.serve")
# The statuses whose input and output a conversation keeps.
_ADDED = ("completed", "incomplete")


class RetrieveQuery(BaseModel):
    """`GET /v1/responses/{id}`'s query: `stream=true` streams a streamed
    background response's events again, after `starting_after`."""

    model_config = ConfigDict(extra="forbid")

    include: str | None = None  # refused unless empty
    stream: bool = False
    starting_after: int | None = Field(None, ge=-1)


class InputItemsQuery(BaseModel):
    """`GET /v1/responses/{id}/input_items`'s query."""

    model_config = ConfigDict(extra="forbid")

    limit: int = Field(20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None


class ResponsesRoute:
    def __init__(self, ingress: Any) -> None:
        self.ingress = ingress
        settings = ingress.cfg.responses
        self.keep = settings.store
        self.store = ResponseStore(settings.storage_path(), settings.retention_hours * 3600,
                                   settings.max_stored) if settings.store else None
        self.background = BackgroundResponses(ingress, self.store) if self.store else None
        self.conversations = ConversationsRoute(
            ConversationStore(settings.storage_path() / "conversations")
            if settings.store else None, ingress.cfg.max_request_bytes)

    def routes(self) -> list[Route]:
        return [*self.conversations.routes(),
                Route("/v1/responses", self.create, methods=["POST"]),
                # One route for both methods, so a 405 lists both in `Allow`.
                Route("/v1/responses/{response_id}", self.stored_response,
                      methods=["GET", "DELETE"]),
                Route("/v1/responses/{response_id}/input_items", self.input_items,
                      methods=["GET"]),
                Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        out = await self._respond(await self.ingress.parse_body(request, ResponsesRequest))
        return out if isinstance(out, Response) else JSONResponse(out)

    async def batch_response(self, body: dict[str, Any]) -> dict[str, Any]:
        """A batch line's Response (`Ingress.batch_request`): run as offline
        work, not streamed nor in the background, and not stored unless the
        line says `store: true` (the batch's output file holds it)."""
        req = self.ingress.validate(body, ResponsesRequest)
        for field in ("stream", "background"):
            if getattr(req, field):
                raise APIError(400, f"{field}: a batch request is answered whole, once",
                               field)
        if req.store is None:
            req = req.model_copy(update={"store": False})
        out = await self._respond(req, offline=True)
        assert isinstance(out, dict)  # neither streamed nor in the background
        return out

    async def _respond(self, req: ResponsesRequest, offline: bool = False
                       ) -> Response | dict[str, Any]:
        """The Response object; the stream of its events, or a background
        one's first answer, as a `Response`."""
        ing = self.ingress
        req = req.model_copy(update={"model": req.model or ing.cfg.model_name})
        keep = self.keep if req.store is None else req.store
        if req.background and not keep:
            raise APIError(400, "background: a background response is polled from the "
                           "store, so it cannot be made with store false", "background")
        if (keep or req.previous_response_id) and self.store is None:
            param = "store" if req.store else "previous_response_id"
            raise APIError(400, f"{param}: this server keeps no responses (responses.store: "
                           "false); send the conversation in input", param)
        conv_id = req.conversation_id
        if conv_id is not None and self.conversations.store is None:
            raise APIError(400, "conversation: this server keeps no conversations "
                           "(responses.store: false); send it in input", "conversation")
        context: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            context = (await self._stored(req.previous_response_id,
                                          "previous_response_id")).conversation()
        elif conv_id is not None:
            context = (await self.conversations.read(conv_id, "conversation")).items
        inputs = req.input_records()
        end = self._ending(conv_id, inputs)
        items = [*items_of(context), *req.input]
        try:
            if req.truncation == "auto":
                items = fit(items, lambda kept: self._prompt_tokens(req.chat(kept)),
                            req.max_output_tokens or 1, ing.cfg.max_model_len)
            chat = req.chat(items)
            if offline:
                chat = chat.model_copy(update={"job_class": "offline"})
        except ValidationError as e:
            raise responses_error(validation_error(e)) from None
        except APIError as e:
            raise responses_error(e) from None
        if req.background:
            return await self._in_background(req, chat, context, inputs, end)
        try:
            async with ing.door.start(chat.job_class == "offline", chat.priority):
                builder, stream = await ing.start_chat(chat)
        except APIError as e:
            raise responses_error(e) from None
        response_id, created = new_response_id(), now()
        record = (lambda response: StoredResponse(
            response=response, context=context, input_items=inputs)) if keep else None
        if req.stream:
            return StreamingResponse(
                self._events(req, builder, stream, response_id, created, record, end),
                media_type="text/event-stream")
        out = await ing.collect(builder, stream)
        output, status = output_of(out)
        response = response_object(req, response_id, created, status, output,
                                   usage_of(out["usage"]), keep)
        await end(response)
        if record is not None and not await self._put(record(response)):
            response["store"] = False
        return response

    async def _in_background(self, req: ResponsesRequest, chat: Any,
                             context: list[dict[str, Any]], inputs: list[dict[str, Any]],
                             end: Ending) -> Response:
        """Answered at once, `queued`; run by `BackgroundResponses`.  What
        the foreground refuses before admission (a prompt too long for the
        context, a schema or tool that cannot be enforced, a format the
        reasoning parser cannot serve) is refused here too (400), rather
        than found failed at the poll."""
        ing = self.ingress
        try:
            tools, _, ids = chat_ids(chat, ing.tokenizer, ing.tool_format)
            check_reasoning(chat, tools, ing.cfg.reasoning_parser)
            await requested_structure(chat, tools)  # its verdicts are cached for the run
        except APIError as e:
            raise responses_error(e) from None
        n = len(ids)
        limit = self.ingress.cfg.max_model_len
        if n + (req.max_output_tokens or 1) > limit:
            raise APIError(400, f"the input is {n} tokens; with max_output_tokens it exceeds "
                           f"this model's maximum context length of {limit} tokens", "input")
        assert self.background is not None
        rid, created = new_response_id(), now()
        response = response_object(req, rid, created, "queued", [], None, True)
        record = StoredResponse(response=response, context=context, input_items=inputs,
                                background=True)
        if not await self._put(record):
            raise APIError(500, "the background response could not be stored")
        if not req.stream:
            self.background.start(req, chat, record, end)
            return JSONResponse(response)
        events = ResponseEvents(req, rid, created, stored=True)
        try:
            await asyncio.to_thread(self.store.log_events, rid,  # type: ignore[union-attr]
                                    events.opening(queued=True))
        except OSError as e:
            await asyncio.to_thread(self.store.delete, rid)  # type: ignore[union-attr]
            raise APIError(500, f"the background response's events could not be kept: {e}")
        self.background.start(req, chat, record, end, events)
        return self._follow(rid, -1)

    def _follow(self, rid: str, after: int) -> Response:
        background = self.background
        assert background is not None

        async def events() -> AsyncIterator[str]:
            async with aclosing(background.follow(rid, after)) as followed:
                async for e in followed:
                    yield sse(e)

        return StreamingResponse(events(), media_type="text/event-stream")

    async def cancel(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        found = await self._stored(response_id, "response_id")
        if not found.background:
            raise APIError(400, "only a background response can be cancelled", "response_id")
        assert self.background is not None
        if found.response["status"] in OPEN:
            found = await self.background.cancel(response_id) or found
        return JSONResponse(found.response)

    async def _events(self, req: ResponsesRequest, builder: Any, stream: Any,
                      response_id: str, created: float, record: Any,
                      end: Ending) -> AsyncIterator[str]:
        events = ResponseEvents(req, response_id, created, stored=record is not None)
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
        closing = events.closing(builder.usage())
        final = closing[-1]["response"]
        await end(final)
        if record is not None and not await self._put(record(final)):
            final["store"] = False
        for e in closing:
            yield sse(e)

    async def stored_response(self, request: Request) -> Response:
        if request.method == "DELETE":
            return await self.delete(request)
        return await self.retrieve(request)

    async def retrieve(self, request: Request) -> Response:
        try:
            query = RetrieveQuery.model_validate(dict(request.query_params))
        except ValidationError as e:
            raise validation_error(e) from None
        if request.query_params.getlist("include"):
            raise APIError(400, "include: not supported by this server", "include")
        if query.starting_after is not None and not query.stream:
            raise APIError(400, "starting_after: only with stream=true", "starting_after")
        rid = request.path_params["response_id"]
        found = await self._stored(rid, "response_id")
        if not query.stream:
            return JSONResponse(found.response)
        assert self.store is not None
        if not found.background or not await asyncio.to_thread(self.store.has_events, rid):
            raise APIError(400, "stream: only a background response made with stream: true "
                           "can be streamed again", "stream")
        return self._follow(rid, -1 if query.starting_after is None else query.starting_after)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        found = await self._stored(response_id, "response_id")
        if found.background and found.response["status"] in OPEN:
            assert self.background is not None  # stopped first, or it would write again
            await self.background.cancel(response_id)
        assert self.store is not None
        if not await asyncio.to_thread(self.store.delete, response_id):
            raise _missing(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        try:
            query = InputItemsQuery.model_validate(dict(request.query_params))
        except ValidationError as e:
            raise validation_error(e) from None
        found = await self._stored(request.path_params["response_id"], "response_id")
        items = found.input_items if query.order == "asc" else found.input_items[::-1]
        page, more = page_after(items, [i["id"] for i in items], query.after, query.limit,
                                "input item")
        return JSONResponse(list_object(page, more))

    def _ending(self, conv_id: str | None, inputs: list[dict[str, Any]]) -> Ending:
        """What a response does once it has its answer, before the client
        sees it: in a conversation, add its input and output there (a
        follow-up sent on reading it finds them).  A failed or cancelled
        one adds nothing."""
        async def end(response: dict[str, Any]) -> None:
            store = self.conversations.store
            if conv_id is None or store is None or response["status"] not in _ADDED:
                return
            try:
                added = await asyncio.to_thread(store.add_items, conv_id,
                                                [*inputs, *response["output"]])
            except OSError as e:
                log.error("response %s not added to %s: %s", response["id"], conv_id, e)
                return
            if added is None:
                log.warning("conversation %s was deleted before response %s ended",
                            conv_id, response["id"])

        return end

    def _prompt_tokens(self, chat: Any) -> int:
        """How many tokens `chat`'s prompt is, as the ingress will render it."""
        return len(chat_ids(chat, self.ingress.tokenizer, self.ingress.tool_format)[2])

    async def _stored(self, response_id: str, param: str) -> StoredResponse:
        found = None if self.background is None else await self.background.read(response_id)
        if found is None:
            raise _missing(response_id, param)
        return found

    async def _put(self, record: StoredResponse) -> bool:
        assert self.background is not None  # there whenever the store is
        return await self.background.write(record)


def _missing(response_id: str, param: str) -> APIError:
    return APIError(404, f"no stored response {response_id[:100]!r} (never stored, deleted "
                    "or expired)", param)


# Chat's names in an error's message, and the Responses fields they stand for.
