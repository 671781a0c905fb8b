"""Anthropic's Message Batches API on the ingress, over this server's batches.

    POST /v1/messages/batches                  create (`requests`: custom_id, params)
    GET  /v1/messages/batches                  list (newest first; `limit`,
                                               `after_id`, `before_id`)
    GET  /v1/messages/batches/{id}             the MessageBatch
    POST /v1/messages/batches/{id}/cancel      stop its job
    GET  /v1/messages/batches/{id}/results     its results, JSONL, once ended
    DELETE /v1/messages/batches/{id}           delete an ended one, its files too

A create writes the requests as an input file of `/v1/messages` lines (a
File of purpose `batch`, listed in `/v1/files`) and starts the batch's Ray
Job as `POST /v1/batches` does: its lines run as offline work, resumable,
within the completion window.  The objects are made from the batch's
(api/message_batches.py).  Errors have Anthropic's shape.
"""

from __future__ import annotations

import asyncio
import io
import json
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.errors import APIError, validation_error
from api.http import read_model
from api.message_batches import (
    MessageBatchCreate,
    MessageBatchListQuery,
    message_batch,
    result_line,
)
from api.messages_api import anthropic_errors
from batch.journal import read_results
from batch.lines import Request as LineRequest
from batch.lines import parse_batch
from batch.store import BatchRecord

if TYPE_CHECKING:
    from batch.routes import BatchRoutes

ENDPOINT = "/v1/messages"


class MessageBatchRoutes:
    def __init__(self, batch_routes: BatchRoutes) -> None:
        self.base = batch_routes
        self.batches = batch_routes.batches

    def routes(self) -> list[Route]:
        root = "/v1/messages/batches"
        return [Route(root, anthropic_errors(self.root), methods=["GET", "POST"]),
                Route(f"{root}/{{batch_id}}", anthropic_errors(self.one),
                      methods=["GET", "DELETE"]),
                Route(f"{root}/{{batch_id}}/cancel", anthropic_errors(self.cancel),
                      methods=["POST"]),
                Route(f"{root}/{{batch_id}}/results", anthropic_errors(self.results),
                      methods=["GET"])]

    async def root(self, request: Request) -> Response:
        if request.method == "POST":
            return await self.create(request)
        return await self.list(request)

    async def create(self, request: Request) -> Response:
        settings = self.base.settings
        req = await read_model(request, MessageBatchCreate, settings.max_file_bytes)
        seen: set[str] = set()
        for i, r in enumerate(req.requests):
            if r.custom_id in seen:
                raise APIError(400, f"custom_id {r.custom_id!r} names more than one request",
                               f"requests.{i}.custom_id")
            seen.add(r.custom_id)
        lines = b"".join(json.dumps({"custom_id": r.custom_id, "method": "POST",
                                     "url": ENDPOINT, "body": r.params},
                                    ensure_ascii=False).encode() + b"\n"
                         for r in req.requests)
        store = self.batches.store
        upload = await asyncio.to_thread(
            store.add_file, io.BytesIO(lines), "message_batch.jsonl", len(lines),
            settings.upload_expiry_s())
        record = await self.base.jobs_call(lambda: self.batches.create(
            upload, ENDPOINT, self.base.app(), settings.max_concurrency,
            model=self.base.model, window_s=settings.window_s()))
        return JSONResponse(await self._view(record))

    async def list(self, request: Request) -> Response:
        try:
            query = MessageBatchListQuery.model_validate(dict(request.query_params))
        except ValidationError as e:
            raise validation_error(e) from None
        records = [r for r in await asyncio.to_thread(self.batches.store.batches)
                   if r.endpoint == ENDPOINT]
        ids = [r.id for r in records]
        for key, param in ((query.after_id, "after_id"), (query.before_id, "before_id")):
            if key is not None and key not in ids:
                raise APIError(404, f"no message batch {key[:100]!r}", param)
        start = 0 if query.after_id is None else ids.index(query.after_id) + 1
        end = len(ids) if query.before_id is None else ids.index(query.before_id)
        if query.before_id is not None and query.after_id is None:
            # The page just before `before_id`; more lie before it.
            start = max(0, end - query.limit)
            more = start > 0
        else:
            more = start + query.limit < end
        page = records[start:min(end, start + query.limit)]
        data = [await self._view(r) for r in page]
        return JSONResponse({"data": data, "has_more": more,
                             "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None})

    async def one(self, request: Request) -> Response:
        record = self._batch(request)
        if request.method == "DELETE":
            if (await self._view(record))["processing_status"] != "ended":
                raise APIError(400, f"message batch {record.id} has not ended; cancel it "
                               "first", "batch_id")
            await self.base.jobs_call(lambda: self.batches.delete(record, with_input=True))
            return JSONResponse({"id": record.id, "type": "message_batch_deleted"})
        return JSONResponse(await self._view(record))

    async def cancel(self, request: Request) -> Response:
        record = self._batch(request)
        return JSONResponse(await self._view(
            await self.base.jobs_call(lambda: self.batches.cancel(record))))

    async def results(self, request: Request) -> Response:
        record = self._batch(request)
        view = await self._view(record)
        if view["processing_status"] != "ended":
            raise APIError(400, f"message batch {record.id} has not ended: its results are "
                           "available once processing_status is ended", "batch_id")
        body = await asyncio.to_thread(self._results, record)
        return Response(body, media_type="application/x-jsonl")

    # ------------------------------------------------------------------------

    def _batch(self, request: Request) -> BatchRecord:
        batch_id = request.path_params["batch_id"]
        record = self.batches.store.batch(batch_id)
        if record is None or record.endpoint != ENDPOINT:
            raise APIError(404, f"no message batch {batch_id[:100]!r}", "batch_id")
        return record

    async def _view(self, record: BatchRecord) -> dict[str, Any]:
        def view() -> dict[str, Any]:
            output, errors = (read_results(p) for p in self.batches.result_paths(record))
            return message_batch(self.batches.describe(record), output, errors)

        return await self.base.jobs_call(view)

    def _results(self, record: BatchRecord) -> bytes:
        """Every request's result: those written, then `canceled` for the
        requests the batch ended without."""
        output, errors = (read_results(p) for p in self.batches.result_paths(record))
        lines = [result_line(r) for r in (*output, *errors)]
        done = {r.custom_id for r in (*output, *errors)}
        source = self.batches.store.file(record.input_file_id)
        if source is not None:
            data = self.batches.store.content_path(source).read_bytes()
            lines += [{"custom_id": item.custom_id, "result": {"type": "canceled"}}
                      for item in parse_batch(data, ENDPOINT)
                      if isinstance(item, LineRequest) and item.custom_id not in done]
        return b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n"
                        for line in lines)
