"""`/v1/files` and `/v1/batches` as OpenAI serves them, on the ingress.

    POST /v1/files                     multipart upload, `purpose=batch`
                                       (`expires_after[anchor]`, `[seconds]`)
    GET  /v1/files                     list (newest first; `purpose`, `limit`,
                                       `order`, `after`)
    GET  /v1/files/{id}                the File object
    DELETE /v1/files/{id}              delete it (not while a running batch uses it)
    GET  /v1/files/{id}/content        the file (a results file: its complete lines)
    POST /v1/batches                   create a batch and start its Ray Job
    GET  /v1/batches                   list (newest first; `limit`, `after`)
    GET  /v1/batches/{id}              the Batch object
    POST /v1/batches/{id}/cancel       stop its job
    /v1/messages/batches...            Anthropic's Message Batches over the same
                                       batches (batch/message_batch_routes.py)

Every failure is an `APIError` (api/errors.py), answered as OpenAI's JSON
error by the ingress's handlers.  Files and the Ray Jobs API are reached
from a thread, off the ingress's event loop.  Expired files are swept
(batch/service.py) on an upload or a listing, at most once a minute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message

from api.batch import (
    BatchCreateRequest,
    BatchList,
    BatchListQuery,
    FileDeleted,
    FileList,
    FileListQuery,
    UploadExpiry,
)
from api.config import BatchSettings
from api.errors import APIError, validation_error
from api.http import read_json_object
from api.pages import page_after
from batch.jobs import JobsUnavailable
from batch.message_batch_routes import MessageBatchRoutes
from batch.service import BatchConflict, Batches
from batch.store import BatchRecord, FileRecord, TooLarge

log = logging.getLogger(__name__)

# Room for the multipart framing around the file.
_FORM_OVERHEAD = 64 * 1024
_EXPIRY_FIELDS = {"expires_after[anchor]": "anchor", "expires_after[seconds]": "seconds"}
_UPLOAD_FIELDS = {"file", "purpose", *_EXPIRY_FIELDS}
_CHUNK = 1 << 20
_SWEEP_EVERY_S = 60.0

T = TypeVar("T")


class BatchRoutes:
    """The routes, over `batches`; `app` names the Serve application the
    batches' requests go to, `model` the model it serves."""

    def __init__(self, batches: Batches, settings: BatchSettings, app: Callable[[], str],
                 model: str, max_request_bytes: int) -> None:
        self.batches = batches
        self.settings = settings
        self.app = app
        self.model = model
        self.max_request_bytes = max_request_bytes
        self._swept = -_SWEEP_EVERY_S
        self._sweeping: asyncio.Task[None] | None = None  # held: not collected mid-run

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", self.files_root, methods=["GET", "POST"]),
            Route("/v1/files/{file_id}", self.file_root, methods=["GET", "DELETE"]),
            Route("/v1/files/{file_id}/content", self.content, methods=["GET"]),
            # One route for both methods, so a 405 lists both in `Allow`.
            Route("/v1/batches", self.batches_root, methods=["GET", "POST"]),
            Route("/v1/batches/{batch_id}", self.retrieve, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"]),
            # Anthropic's Message Batches, over the same batches.
            *MessageBatchRoutes(self).routes(),
        ]

    # Files ----------------------------------------------------------------

    async def files_root(self, request: Request) -> Response:
        if request.method == "POST":
            return await self.upload(request)
        return await self.list_files(request)

    async def file_root(self, request: Request) -> Response:
        if request.method == "DELETE":
            return await self.delete_file(request)
        return await self.file_info(request)

    def _sweep(self) -> None:
        """Expired files, at most every `_SWEEP_EVERY_S`, apart from the
        request that starts it (which does not wait); a sweep that cannot
        reach the Jobs API waits for the next."""
        now = time.monotonic()
        if now - self._swept < _SWEEP_EVERY_S:
            return
        self._swept = now

        async def sweep() -> None:
            try:
                gone = await asyncio.to_thread(self.batches.sweep)
            except JobsUnavailable as e:
                log.warning("expired files not swept: %s", e)
                return
            except Exception:  # noqa: BLE001 - a sweep must not take the ingress down
                log.exception("sweeping expired batch files failed")
                return
            if gone:
                log.info("deleted %d expired batch file(s)", gone)

        self._sweeping = asyncio.get_running_loop().create_task(sweep())

    async def upload(self, request: Request) -> Response:
        content_type = request.headers.get("content-type", "")
        if not content_type.lower().startswith("multipart/form-data"):
            raise APIError(415, "upload a file as multipart/form-data "
                           f"(got Content-Type {content_type[:100]!r})")
        limit = self.settings.max_file_bytes + _FORM_OVERHEAD
        declared = request.headers.get("content-length", "").strip()
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the upload is {declared} bytes; files are limited to "
                           f"{self.settings.max_file_bytes} bytes")
        bounded = Request(request.scope, _bounded_receive(request.receive, limit))
        async with bounded.form(max_files=1, max_fields=len(_UPLOAD_FIELDS)) as form:
            unknown = sorted(set(form.keys()) - _UPLOAD_FIELDS)
            if "expires_after" in unknown:
                raise APIError(400, "expires_after: send its parts as the form fields "
                               "expires_after[anchor] and expires_after[seconds]",
                               "expires_after")
            if unknown:
                raise APIError(400, f"{unknown[0]}: unrecognized request argument", unknown[0])
            purpose, upload = form.get("purpose"), form.get("file")
            if not isinstance(purpose, str):
                raise APIError(400, "purpose: a form field is required", "purpose")
            if purpose != "batch":
                raise APIError(400, f"purpose: {purpose[:40]!r} is not supported; this "
                               "server takes files for the Batch API only ('batch')", "purpose")
            if not isinstance(upload, UploadFile):
                raise APIError(400, "file: a file part is required", "file")
            expires_s = _expiry(form, self.settings.upload_expiry_s())
            filename = upload.filename or "upload.jsonl"
            try:
                record = await asyncio.to_thread(
                    self.batches.store.add_file, upload.file, filename,
                    self.settings.max_file_bytes, expires_s)
            except TooLarge as e:
                raise APIError(413, str(e), "file")
        self._sweep()
        return JSONResponse(self.batches.store.file_object(record).model_dump())

    async def list_files(self, request: Request) -> Response:
        try:
            query = FileListQuery.model_validate(dict(request.query_params))
        except ValidationError as e:
            raise validation_error(e)
        self._sweep()
        records = await asyncio.to_thread(self.batches.store.files)
        if query.purpose is not None:
            records = [r for r in records if r.purpose == query.purpose]
        if query.order == "desc":
            records.reverse()
        page, more = page_after(records, [r.id for r in records], query.after, query.limit,
                                "file")
        data = await asyncio.to_thread(lambda: [self.batches.store.file_object(r)
                                                for r in page])
        return JSONResponse(FileList(
            data=data, first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None, has_more=more).model_dump())

    async def delete_file(self, request: Request) -> Response:
        record = self._file(request)
        await self.jobs_call(lambda: self.batches.delete_file(record))
        return JSONResponse(FileDeleted(id=record.id, deleted=True).model_dump())

    def _file(self, request: Request) -> FileRecord:
        file_id = request.path_params["file_id"]
        return _found(self.batches.store.file(file_id), "file", file_id, "file_id")

    async def file_info(self, request: Request) -> Response:
        record = self._file(request)
        obj = await asyncio.to_thread(self.batches.store.file_object, record)
        return JSONResponse(obj.model_dump())

    async def content(self, request: Request) -> Response:
        record = self._file(request)
        path = self.batches.store.content_path(record)
        # A results file may be growing: send the complete lines there are now.
        size = await asyncio.to_thread(self.batches.store.content_size, record)
        if size == 0:  # a results file not written yet
            return Response(b"", media_type="application/octet-stream")
        return StreamingResponse(_read(path, size), media_type="application/octet-stream",
                                 headers={"content-length": str(size)})

    # Batches --------------------------------------------------------------

    async def batches_root(self, request: Request) -> Response:
        if request.method == "POST":
            return await self.create(request)
        return await self.list_batches(request)

    async def create(self, request: Request) -> Response:
        data = await read_json_object(request, self.max_request_bytes)
        try:
            req = BatchCreateRequest.model_validate(data)
        except ValidationError as e:
            raise validation_error(e)
        input_file = _found(self.batches.store.file(req.input_file_id), "file",
                            req.input_file_id, "input_file_id")
        if input_file.purpose != "batch":
            raise APIError(400, f"file {input_file.id} is a batch's results, not an input "
                           "file (purpose 'batch')", "input_file_id")
        expiry = req.output_expires_after
        record = await self.jobs_call(lambda: self.batches.create(
            input_file, req.endpoint, self.app(), self.settings.max_concurrency,
            metadata=req.metadata, model=self.model,
            output_expires_after_s=expiry.seconds if expiry else None,
            window_s=self.settings.window_s()))
        return await self._describe(record)

    async def list_batches(self, request: Request) -> Response:
        try:
            query = BatchListQuery.model_validate(dict(request.query_params))
        except ValidationError as e:
            raise validation_error(e)
        records = await asyncio.to_thread(self.batches.store.batches)
        page, more = page_after(records, [r.id for r in records], query.after, query.limit,
                                "batch")
        data = await self.jobs_call(lambda: self.batches.describe_all(page))
        return JSONResponse(BatchList(
            data=data, first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None, has_more=more).model_dump())

    def _batch(self, request: Request) -> BatchRecord:
        batch_id = request.path_params["batch_id"]
        return _found(self.batches.store.batch(batch_id), "batch", batch_id, "batch_id")

    async def retrieve(self, request: Request) -> Response:
        return await self._describe(self._batch(request))

    async def cancel(self, request: Request) -> Response:
        record = self._batch(request)
        return await self._describe(await self.jobs_call(lambda: self.batches.cancel(record)))

    async def _describe(self, record: BatchRecord) -> Response:
        obj = await self.jobs_call(lambda: self.batches.describe(record))
        return JSONResponse(obj.model_dump())

    async def jobs_call(self, call: Callable[[], Any]) -> Any:
        """`call` in a thread; the Ray Jobs API out of reach is a 503."""
        try:
            return await asyncio.to_thread(call)
        except JobsUnavailable as e:
            raise APIError(503, f"{e}; batches need the Ray dashboard",
                           type_="service_unavailable")
        except BatchConflict as e:
            raise APIError(400, str(e))


def _found(record: T | None, what: str, key: str, param: str) -> T:
    if record is None:
        raise APIError(404, f"no {what} {key[:100]!r}", param)
    return record


def _expiry(form: Any, default_s: int | None) -> int | None:
    """The upload's `expires_after` seconds from its two form fields;
    `default_s` without them."""
    parts = {key: form.get(field) for field, key in _EXPIRY_FIELDS.items() if field in form}
    if not parts:
        return default_s
    seconds = parts.get("seconds")
    if isinstance(seconds, str) and seconds.strip().isdigit():
        parts["seconds"] = int(seconds)
    try:
        return UploadExpiry.model_validate({"expires_after": parts}).expires_after.seconds
    except ValidationError as e:
        raise validation_error(e)


def _bounded_receive(receive: Callable[[], Any], limit: int) -> Callable[[], Any]:
    """`receive`, refusing a body (a chunked one too) past `limit` bytes."""
    seen = 0

    async def bounded() -> Message:
        nonlocal seen
        message: Message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise APIError(413, f"the upload exceeds the limit of {limit} bytes")
        return message

    return bounded


async def _read(path: Path, size: int) -> AsyncIterator[bytes]:
    with open(path, "rb") as f:
        left = size
        while left > 0:
            chunk = await asyncio.to_thread(f.read, min(_CHUNK, left))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk
