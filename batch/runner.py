"""Running a batch: every line not yet done, sent with bounded concurrency,
its result written as it lands.

Plain asyncio: the sender (a Serve handle in the job, a fake in tests) and
the progress display are passed in.  A request the server could not take
now (429: at capacity; 503: its engine replica failed or restarted) or that
never reached it (the handle raised: an ingress replica restarting) is
retried with exponential backoff, never written as an error; one that is
still refused after `RetryPolicy.timeout_s` stops the run with
`RetriesExhausted`, leaving it unwritten, so resuming the batch sends it
again.

At `expires_at` (the batch's completion window, OpenAI's semantics) the
requests in flight are cancelled (their engine jobs aborted) and every
line without a result is written as a `batch_expired` error; the results
written before stay.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from api.batch import BatchError, BatchResponse
from batch.journal import Journal
from batch.lines import Item, Rejected, Request

log = logging.getLogger(__name__)

# Statuses that say "not now" rather than "not this request".
RETRYABLE_STATUSES = frozenset({429, 503})

Sender = Callable[[str, dict[str, Any]], Awaitable[BatchResponse]]


class RetryPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    base_s: float = Field(0.5, gt=0)
    cap_s: float = Field(30.0, gt=0)
    # How long one request may keep being refused before the run stops.
    timeout_s: float = Field(900.0, gt=0)

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Backoff before retry `attempt` (from 1): doubling up to the cap,
        the second half jittered so that refused requests spread out."""
        d = min(self.cap_s, self.base_s * 2 ** (attempt - 1))
        return d / 2 + rng.random() * d / 2


class RetriesExhausted(RuntimeError):
    """A request was refused (429/503) or unreachable for longer than the
    retry budget; it is left for a resumed run."""


class Progress(Protocol):
    def start(self, total: int, done: int) -> None: ...

    def finished(self, ok: bool) -> None: ...

    def retried(self) -> None: ...


class NoProgress:
    def start(self, total: int, done: int) -> None:
        pass

    def finished(self, ok: bool) -> None:
        pass

    def retried(self) -> None:
        pass


class RunSummary(BaseModel):
    total: int
    # Done before this run started (a resumed batch).
    skipped: int
    completed: int
    failed: int
    retries: int
    # Lines written as `batch_expired` at the completion window's end.
    expired: int = 0


async def run_batch(items: Sequence[Item], journal: Journal, send: Sender, *,
                    max_concurrency: int, retry: RetryPolicy | None = None,
                    progress: Progress | None = None,
                    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                    clock: Callable[[], float] = time.monotonic,
                    rng: random.Random | None = None, expires_at: float | None = None,
                    wall: Callable[[], float] = time.time) -> RunSummary:
    """Send what `journal` does not hold yet; `journal` must be open.
    `expires_at`: the wall-clock time (`wall`) the batch expires at."""
    if max_concurrency < 1:
        raise ValueError("max_concurrency must be at least 1")
    retry = retry or RetryPolicy()
    progress = progress or NoProgress()
    rng = rng or random.Random()
    todo = [i for i in items if not journal.is_done(i)]
    progress.start(len(items), len(items) - len(todo))
    summary = RunSummary(total=len(items), skipped=len(items) - len(todo),
                         completed=0, failed=0, retries=0)

    def landed(ok: bool) -> None:
        if ok:
            summary.completed += 1
        else:
            summary.failed += 1
        progress.finished(ok)

    for item in todo:
        if isinstance(item, Rejected):
            journal.record_rejected(item)
            landed(False)
    queue = deque(i for i in todo if isinstance(i, Request))

    async def answer(req: Request) -> BatchResponse:
        started = clock()
        attempt = 0
        while True:
            try:
                response = await send(req.url, req.body)
                if response.status_code not in RETRYABLE_STATUSES:
                    return response
                why = f"status {response.status_code}: {_message(response)}"
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the handle: replica gone, app redeploying, ...
                why = f"{type(e).__name__}: {e}"
            attempt += 1
            delay = retry.delay(attempt, rng)
            if clock() - started + delay > retry.timeout_s:
                raise RetriesExhausted(f"custom_id {req.custom_id!r} (line {req.line}) was "
                                       f"refused for {retry.timeout_s:.0f} s; last: {why}")
            log.info("custom_id %r: %s; retry %d in %.1f s", req.custom_id, why, attempt, delay)
            summary.retries += 1
            progress.retried()
            await sleep(delay)

    async def worker() -> None:
        while queue:
            req = queue.popleft()
            landed(journal.record_response(req, await answer(req)))

    if expires_at is not None and wall() >= expires_at:  # nothing is sent
        queue.clear()
        summary.expired = _expire(items, journal, landed)
        return summary
    workers = [asyncio.ensure_future(worker()) for _ in range(min(max_concurrency, len(queue)))]
    expired = False
    try:
        if expires_at is None:
            await asyncio.gather(*workers)
        else:
            run = asyncio.gather(*workers)
            window = asyncio.ensure_future(sleep(max(0.0, expires_at - wall())))
            try:
                await asyncio.wait({run, window}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                window.cancel()
            expired = not run.done()
            if not expired:
                await run  # its exception, if a worker raised
    finally:
        # One worker's failure (RetriesExhausted) ends the run, as does the
        # window's end: what is in flight elsewhere is dropped unwritten.
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    if expired:
        summary.expired = _expire(items, journal, landed)
    return summary


def _expire(items: Sequence[Item], journal: Journal, landed: Callable[[bool], None]) -> int:
    """Write every line without a result as expired (each a failed line for
    the summary and the progress); how many."""
    n = 0
    for item in items:
        if not journal.is_done(item):
            journal.record_rejected(Rejected(item.line, item.custom_id, BatchError(
                code="batch_expired", line=item.line, message="this request could not be "
                "executed before the batch's completion window ended")))
            landed(False)
            n += 1
    return n


def _message(response: BatchResponse) -> str:
    error = response.body.get("error")
    if isinstance(error, dict):
        return str(error.get("message", ""))[:200]
    return ""
