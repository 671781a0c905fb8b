"""`/v1/conversations`: OpenAI's Conversations API over the conversation
store (api/conversation_store.py).

    POST   /v1/conversations                      create (`items`, `metadata`)
    GET    /v1/conversations/{id}                 the Conversation object
    POST   /v1/conversations/{id}                 replace its `metadata`
    DELETE /v1/conversations/{id}                 delete it and its items
    GET    /v1/conversations/{id}/items           its items (newest first unless
                                                  `order` is asc; `limit`, `after`)
    POST   /v1/conversations/{id}/items           add up to 20 items
    GET    /v1/conversations/{id}/items/{item}    one item
    DELETE /v1/conversations/{id}/items/{item}    delete one; the Conversation

A Response names one with `conversation` (deployments/responses_route.py).
Store files are reached from a thread, off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.conversation_store import ConversationRecord, ConversationStore, NoItem
from api.conversations import (
    ConversationCreate,
    ConversationUpdate,
    ItemsCreate,
    ItemsQuery,
    conversation_object,
)
from api.errors import APIError, validation_error
from api.http import read_model
from api.pages import list_object, no_params, page_after
from api.responses_api import item_records

M = TypeVar("M", bound=BaseModel)


class ConversationsRoute:
    """`store` None: the server keeps nothing (`responses.store: false`)."""

    def __init__(self, store: ConversationStore | None, max_request_bytes: int) -> None:
        self.store = store
        self.max_request_bytes = max_request_bytes

    async def parse_body(self, request: Request, model: type[M]) -> M:
        return await read_model(request, model, self.max_request_bytes)

    def routes(self) -> list[Route]:
        base = "/v1/conversations/{conversation_id}"
        # One route per path for all its methods, so a 405 lists them in `Allow`.
        return [Route("/v1/conversations", self.create, methods=["POST"]),
                Route(base, self.conversation, methods=["GET", "POST", "DELETE"]),
                Route(f"{base}/items", self.items, methods=["GET", "POST"]),
                Route(f"{base}/items/{{item_id}}", self.item, methods=["GET", "DELETE"])]

    async def create(self, request: Request) -> Response:
        store = self._store()
        req = await self.parse_body(request, ConversationCreate)
        record = await asyncio.to_thread(store.create, req.metadata or {},
                                         item_records(req.items or []))
        return _object(record)

    async def conversation(self, request: Request) -> Response:
        store = self._store()
        conv_id = request.path_params["conversation_id"]
        if request.method == "POST":
            req = await self.parse_body(request, ConversationUpdate)
            found = await asyncio.to_thread(store.set_metadata, conv_id, req.metadata)
            return _object(_found(found, conv_id))
        if request.method == "DELETE":
            if not await asyncio.to_thread(store.delete, conv_id):
                raise missing(conv_id, "conversation_id")
            return JSONResponse({"id": conv_id, "object": "conversation.deleted",
                                 "deleted": True})
        return _object(await self.read(conv_id, "conversation_id"))

    async def items(self, request: Request) -> Response:
        store = self._store()
        conv_id = request.path_params["conversation_id"]
        params = _without_include(request)
        if request.method == "POST":
            no_params(params)
            req = await self.parse_body(request, ItemsCreate)
            added = await asyncio.to_thread(store.add_items, conv_id, item_records(req.items))
            return JSONResponse(list_object(_found(added, conv_id)))
        try:
            query = ItemsQuery.model_validate(params)
        except ValidationError as e:
            raise validation_error(e) from None
        record = await self.read(conv_id, "conversation_id")
        items = record.items if query.order == "asc" else record.items[::-1]
        page, more = page_after(items, [i["id"] for i in items], query.after, query.limit,
                                "item")
        return JSONResponse(list_object(page, more))

    async def item(self, request: Request) -> Response:
        store = self._store()
        conv_id = request.path_params["conversation_id"]
        item_id = request.path_params["item_id"]
        no_params(_without_include(request))
        if request.method == "DELETE":
            try:
                found = await asyncio.to_thread(store.delete_item, conv_id, item_id)
            except NoItem:
                raise _no_item(item_id) from None
            return _object(_found(found, conv_id))
        got = (await self.read(conv_id, "conversation_id")).item(item_id)
        if got is None:
            raise _no_item(item_id)
        return JSONResponse(got)

    async def read(self, conv_id: str, param: str) -> ConversationRecord:
        """The conversation; a 404 naming `param` where there is none."""
        found = await asyncio.to_thread(self._store().get, conv_id)
        if found is None:
            raise missing(conv_id, param)
        return found

    def _store(self) -> ConversationStore:
        if self.store is None:
            raise APIError(400, "this server keeps no conversations (responses.store: false); "
                           "send the conversation in a Response's input")
        return self.store


def missing(conv_id: str, param: str) -> APIError:
    return APIError(404, f"no conversation {conv_id[:100]!r} (never made, or deleted)", param)


def _found(found: Any, conv_id: str) -> Any:
    if found is None:
        raise missing(conv_id, "conversation_id")
    return found


def _no_item(item_id: str) -> APIError:
    return APIError(404, f"no item {item_id[:100]!r} in this conversation", "item_id")


def _object(record: ConversationRecord) -> Response:
    return JSONResponse(conversation_object(record.id, record.created_at, record.metadata))


def _without_include(request: Request) -> dict[str, str]:
    """The query but `include`, which is refused unless empty: no item
    carries more than it was stored with."""
    if any(request.query_params.getlist("include")):
        raise APIError(400, "include: not supported by this server", "include")
    return {k: v for k, v in request.query_params.items() if k != "include"}
