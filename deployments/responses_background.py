"""`background: true` Responses: answered at once as `queued`, run by the
Ingress replica that took them, polled with `GET /v1/responses/{id}` on any
replica, cancelled with `POST /v1/responses/{id}/cancel` on any replica.

The record in the store (`api/responses_store.py`) is the one truth every
replica reads: `queued` when accepted, `in_progress` once the engine
admitted it, then `completed`, `incomplete`, `failed` or `cancelled`.  A
refusal for load (429) is waited out (its `Retry-After`) rather than failing
the response.  While it runs, its replica touches the record's `.alive`
mark every `HEARTBEAT_S` and looks for a `.cancel` mark (a cancellation that
landed on another replica) every `POLL_S`; a response still open whose
mark has gone silent for `STALE_S` lost its replica, and reads as `failed`;
one its replica stops while shutting down (no client asked) ends `failed`.

A background response made with `stream: true` also logs its events in the
store as it runs (`created` and `queued` when accepted, `in_progress`, the
deltas, and the last one); `follow` streams them from any replica, from the
start or after a `sequence_number` (a client that reconnects), until that
last event, or one made from the record where the run ended without it
(its replica lost).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from api.errors import APIError
from api.responses_api import (
    ResponsesRequest,
    output_of,
    response_object,
    usage_of,
)
from api.responses_errors import responses_error
from api.responses_store import ResponseStore, StoredResponse
from api.responses_stream import ResponseEvents

log = logging.getLogger("ray.serve")

# Called with a response's final object before it is stored as ended.
Ending = Callable[[dict[str, Any]], Awaitable[None]]

HEARTBEAT_S = 5.0
POLL_S = 0.5
STALE_S = 30.0
OPEN = ("queued", "in_progress")
# A stream's last event, whatever ended it.
_LAST = ("response.completed", "response.incomplete", "response.failed")
# How often a follower on another replica looks for new events.
FOLLOW_S = 0.05
# How long a follower waits for the last events of a run whose record ended.
_LAST_WAIT_S = 1.0
# Why an open response that lost its replica (died, or shut down) failed.
_LOST = {"code": "server_error",
         "message": "the server replica running this response stopped before it finished; "
                    "create it again"}


class BackgroundResponses:
    def __init__(self, ingress: Any, store: ResponseStore) -> None:
        self.ingress = ingress
        self.store = store
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Those whose cancellation a client asked for (any other is the
        # replica shutting down).
        self._asked: set[str] = set()
        # Set (and replaced) when a run of this replica logged events: its
        # followers here read them at once instead of at their next look.
        self._logged: dict[str, asyncio.Event] = {}

    def start(self, req: ResponsesRequest, chat: Any, record: StoredResponse,
              end: Ending | None = None, events: ResponseEvents | None = None) -> None:
        """Run `record`'s response (already stored as queued); `end` sees
        its final object before it is stored; `events`: log its events
        (its opening ones logged already)."""
        rid = record.response["id"]
        if events is not None:
            self._logged[rid] = asyncio.Event()
        # A context of its own: Serve cancels the handle calls made in a
        # request's context when that request is cancelled (its client went
        # away), and this run must outlive the request that started it.
        task = asyncio.get_running_loop().create_task(
            self._run(req, chat, record, end, events), context=contextvars.Context())
        self._tasks[rid] = task
        task.add_done_callback(lambda _: (self._tasks.pop(rid, None),
                                          self._logged.pop(rid, None)))

    async def cancel(self, response_id: str, wait_s: float = 5.0) -> StoredResponse | None:
        """Stop a background response; its record once it says so (or as it
        stands after `wait_s`, where another replica runs it and has not
        answered yet).  None: no such record."""
        task = self._tasks.get(response_id)
        if task is not None:  # ours: stop it here, and wait for its last write
            self._asked.add(response_id)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        else:
            await asyncio.to_thread(self.store.ask_cancel, response_id)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                found = await self.read(response_id)
                if found is None or found.response["status"] not in OPEN:
                    return found
                await asyncio.sleep(POLL_S / 2)
        return await self.read(response_id)

    async def read(self, response_id: str) -> StoredResponse | None:
        """The record; an open one whose runner went silent, failed (and
        stored so)."""
        found = await asyncio.to_thread(self.store.get, response_id)
        if (found is None or not found.background or found.response["status"] not in OPEN
                or response_id in self._tasks):
            return found
        if await asyncio.to_thread(self.store.silent_for, response_id) < STALE_S:
            return found
        found.response.update(status="failed", error=_LOST)
        await self.write(found)
        return found

    # ------------------------------------------------------------------------

    async def _run(self, req: ResponsesRequest, chat: Any, record: StoredResponse,
                   end: Ending | None, events: ResponseEvents | None) -> None:
        rid = record.response["id"]
        created = float(record.response["created_at"])
        watcher = asyncio.get_running_loop().create_task(
            self._watch(rid, asyncio.current_task()))
        final: dict[str, Any]
        last: list[dict[str, Any]] = []  # the stream's closing events
        builder = None
        try:
            ing = self.ingress
            builder, stream = await self._admitted(chat)
            record.response["status"] = "in_progress"
            await self.write(record)
            if events is None:
                out = await ing.collect(builder, stream)
                output, status = output_of(out)
                final = response_object(req, rid, created, status, output,
                                        usage_of(out["usage"]), True)
            else:
                last = await self._streamed(rid, events, builder, stream)
                final = last[-1]["response"]
        except asyncio.CancelledError:
            if rid not in self._asked:
                final = {**record.response, "status": "failed", "error": _LOST}
            elif builder is None:  # cancelled before the engine took it
                final = {**record.response, "status": "cancelled"}
            else:  # with what it had written
                out = builder.response()
                final = response_object(req, rid, created, "cancelled", output_of(out)[0],
                                        usage_of(out["usage"]), True)
        except APIError as e:
            e = responses_error(e)
            final = {**record.response, "status": "failed",
                     "error": {"code": e.type, "message": e.message}}
        except Exception as e:  # noqa: BLE001 - the record must end, whatever happened
            log.exception("background response %s failed", rid)
            final = {**record.response, "status": "failed",
                     "error": {"code": "server_error", "message": f"internal error: {e!r}"}}
        finally:
            watcher.cancel()
        self._asked.discard(rid)
        if events is not None and not last:  # stopped short: end the stream
            usage = builder.usage() if builder is not None else None
            last = events.ended(final["status"], usage and usage_of(usage), final.get("error"))
            final = last[-1]["response"]
        record.response = final
        if end is not None:
            await end(final)
        # The marks go first: a reader that finds the record ended finds
        # them gone (a cancel asked meanwhile waits for the record).
        await asyncio.to_thread(self.store.clear_marks, rid)
        await self.write(record)
        # The last events after the record: a client that reads them finds it ended.
        await self._log(rid, last)

    async def _streamed(self, rid: str, events: ResponseEvents, builder: Any,
                        stream: Any) -> list[dict[str, Any]]:
        """Log the answer's events as they come; its closing events (not
        logged yet)."""
        await self._log(rid, events.started())
        async with aclosing(self.ingress.chunks(builder, stream)) as chunks:
            async for chunk in chunks:
                if "error" in chunk:  # the answer failed after its start
                    body = chunk["error"]
                    code = body.get("code")
                    raise APIError(code if isinstance(code, int) else 500,
                                   str(body.get("message")), type_=body.get("type"))
                await self._log(rid, events.feed(chunk))
        return events.closing(builder.usage())

    async def _log(self, rid: str, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        try:
            await asyncio.to_thread(self.store.log_events, rid, events)
        except OSError as e:  # a full disk: the run goes on, its record still ends
            log.error("events of response %s not logged: %s", rid, e)
        if (woken := self._logged.get(rid)) is not None:
            self._logged[rid] = asyncio.Event()
            woken.set()

    async def follow(self, rid: str, after: int) -> AsyncIterator[dict[str, Any]]:
        """The events of streamed background response `rid` with a
        `sequence_number` above `after`, as they are logged, to its last."""
        offset, seen, looked = 0, after, 0.0
        ended: float | None = None  # when the record was first seen ended
        while True:
            # Taken before reading: a log written after the read sets it.
            woken = self._logged.get(rid)
            new, offset = await asyncio.to_thread(self.store.read_events, rid, offset)
            for event in new:
                if event["sequence_number"] > seen:
                    seen = event["sequence_number"]
                    yield event
                if event["type"] in _LAST:
                    return
            if new:
                continue
            now = time.monotonic()
            if now - looked >= POLL_S:  # ended without its last event?
                looked = now
                found = await self.read(rid)
                if found is None or found.response["status"] not in OPEN:
                    # Its runner logs the last events just after the
                    # record: give them a moment before making one up.
                    ended = now if ended is None else ended
                    if found is None or now - ended >= _LAST_WAIT_S:
                        yield _last_event(found, rid, seen + 1)
                        return
            if woken is None:
                await asyncio.sleep(FOLLOW_S)
                continue
            try:
                await asyncio.wait_for(woken.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass

    async def _admitted(self, chat: Any) -> tuple[Any, Any]:
        """The engine's stream for `chat`, a refusal for load waited out."""
        ing = self.ingress
        while True:
            try:
                async with ing.door.start(chat.job_class == "offline", chat.priority):
                    return await ing.start_chat(chat)
            except APIError as e:
                if e.status != 429:
                    raise
                await asyncio.sleep(_retry_after(e.headers.get("Retry-After")))

    async def _watch(self, rid: str, task: asyncio.Task[Any] | None) -> None:
        beat = 0.0
        while True:
            now = time.monotonic()
            if now - beat >= HEARTBEAT_S:
                await asyncio.to_thread(self.store.touch, rid)
                beat = now
            if await asyncio.to_thread(self.store.cancel_asked, rid):
                if task is not None:
                    self._asked.add(rid)
                    task.cancel()
                return
            await asyncio.sleep(POLL_S)

    async def write(self, record: StoredResponse) -> bool:
        """Keep `record` (off the event loop); False where the store fails
        (a full disk, say): the answer still goes out, saying it was not
        stored."""
        try:
            await asyncio.to_thread(self.store.put, record)
        except OSError as e:
            log.error("response %s not stored: %s", record.response["id"], e)
            return False
        return True


def _last_event(found: StoredResponse | None, rid: str, sequence: int) -> dict[str, Any]:
    """The last event of a stream whose run ended without logging one."""
    if found is None:  # deleted while followed
        return {"type": "error", "sequence_number": sequence, "code": "not_found",
                "message": f"response {rid} was deleted", "param": None}
    response = found.response
    if response["status"] == "failed" or response.get("error"):
        return {"type": "response.failed", "sequence_number": sequence, "response": response}
    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
    return {"type": kind, "sequence_number": sequence, "response": response}


def _retry_after(value: str | None, default: float = 1.0) -> float:
    try:
        return min(60.0, max(0.05, float(value))) if value else default
    except ValueError:
        return default

