"""Stored chat completions: OpenAI's `store: true` on `/v1/chat/completions`
and the routes that read them back (api/chat_store.py keeps them).

    GET    /v1/chat/completions                 those stored, oldest first unless
                                                `order` is desc (`model`,
                                                `metadata[key]=value`, `limit`, `after`)
    GET    /v1/chat/completions/{id}            one, as a ChatCompletion object
    POST   /v1/chat/completions/{id}            replace its `metadata`
    DELETE /v1/chat/completions/{id}            delete it
    GET    /v1/chat/completions/{id}/messages   the messages it answered

The ingress keeps a completion whose request said `store: true` once its
answer is whole and before the answer (or a stream's `[DONE]`) is sent, so
a client that reads it back on receiving it finds it on any replica; one
that failed or was cut short is not kept.  Store files are reached from a
thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.chat_store import ChatCompletionStore, NoCursor, StoredChatCompletion
from api.chat_store_api import (
    ChatCompletionsQuery,
    ChatCompletionUpdate,
    MessagesQuery,
    stored_messages,
    stored_object,
)
from api.config import ResponsesSettings
from api.errors import APIError, validation_error
from api.http import read_model
from api.pages import list_object, no_params, page_after
from api.protocol import ChatCompletionRequest

log = logging.getLogger("ray.serve")

class ChatStoreRoute:
    """`store` None: the server keeps nothing (`responses.store: false`)."""

    def __init__(self, store: ChatCompletionStore | None, max_request_bytes: int) -> None:
        self.store = store
        self.max_request_bytes = max_request_bytes

    @classmethod
    def for_settings(cls, settings: ResponsesSettings, max_request_bytes: int
                     ) -> "ChatStoreRoute":
        store = ChatCompletionStore(settings.storage_path() / "chat_completions",
                                    settings.retention_hours * 3600, settings.max_stored)
        return cls(store if settings.store else None, max_request_bytes)

    def routes(self) -> list[Route]:
        # `GET /v1/chat/completions` shares its path with the ingress's POST
        # (Ingress.chat_completions hands it to `list`).
        base = "/v1/chat/completions/{completion_id}"
        return [Route(base, self.completion, methods=["GET", "POST", "DELETE"]),
                Route(f"{base}/messages", self.messages, methods=["GET"])]

    def check(self, req: ChatCompletionRequest) -> None:
        """A 400 for `store: true` where the server keeps nothing."""
        if req.store and self.store is None:
            raise APIError(400, "store: this server keeps no chat completions "
                           "(responses.store: false)", "store")

    async def keep(self, req: ChatCompletionRequest, answer: dict[str, Any]) -> None:
        """Store `answer` where `req` asked for it.  A store that fails
        (a full disk) is logged: the answer, computed, is still sent."""
        if not req.store or self.store is None:
            return
        record = StoredChatCompletion(completion=stored_object(answer, req),
                                      messages=stored_messages(answer["id"], req))
        try:
            await asyncio.to_thread(self.store.put, record)
        except OSError as e:
            log.warning("chat completion %s could not be stored: %r", answer["id"], e)

    async def list(self, request: Request) -> Response:
        store = self._store()
        query = _query(ChatCompletionsQuery.from_params, request.query_params.multi_items())
        try:
            page, more = await asyncio.to_thread(store.page, query.order, query.after,
                                                 query.limit,
                                                 lambda r: query.matches(r.completion))
        except NoCursor:
            raise _missing(str(query.after), "after") from None
        return JSONResponse(list_object([r.completion for r in page], more))

    async def completion(self, request: Request) -> Response:
        store = self._store()
        completion_id = request.path_params["completion_id"]
        if request.method == "POST":
            no_params(request.query_params)
            update = await read_model(request, ChatCompletionUpdate, self.max_request_bytes)
            found = await asyncio.to_thread(store.set_metadata, completion_id,
                                            dict(update.metadata or {}))
            return JSONResponse(_found(found, completion_id).completion)
        if request.method == "DELETE":
            no_params(request.query_params)
            if not await asyncio.to_thread(store.delete, completion_id):
                raise _missing(completion_id, "completion_id")
            return JSONResponse({"object": "chat.completion.deleted", "id": completion_id,
                                 "deleted": True})
        no_params(request.query_params)
        return JSONResponse(_found(await asyncio.to_thread(store.get, completion_id),
                                   completion_id).completion)

    async def messages(self, request: Request) -> Response:
        store = self._store()
        completion_id = request.path_params["completion_id"]
        query = _query(MessagesQuery.model_validate, dict(request.query_params.items()))
        record = _found(await asyncio.to_thread(store.get, completion_id), completion_id)
        messages = record.messages if query.order == "asc" else record.messages[::-1]
        page, more = page_after(messages, [m["id"] for m in messages], query.after,
                                query.limit, "message")
        return JSONResponse(list_object(page, more))

    # ------------------------------------------------------------------------

    def _store(self) -> ChatCompletionStore:
        if self.store is None:
            raise APIError(400, "this server keeps no chat completions "
                           "(responses.store: false)")
        return self.store


def _query(parse: Any, params: Any) -> Any:
    try:
        return parse(params)
    except ValidationError as e:
        raise validation_error(e) from None


def _missing(completion_id: str, param: str) -> APIError:
    return APIError(404, f"no stored chat completion {completion_id[:100]!r} (never stored, "
                    "deleted or expired)", param)


def _found(found: StoredChatCompletion | None, completion_id: str) -> StoredChatCompletion:
    if found is None:
        raise _missing(completion_id, "completion_id")
    return found
