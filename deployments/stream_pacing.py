"""When a request's engine stream sends the output it has gathered.

Every item of an engine stream is a Serve streaming message that costs the
engine replica's core and the Ingress's about 0.4 ms each
(studies/conserve_live/README.md, "Unstreamed"), and every client sees it
as one more chunk. So the engine sends:

- a streaming client's first token at once, then its tokens an item an
  iteration, or with `stream_interval` N once a choice has gathered N
  tokens (SGLang's and vLLM's `--stream-interval`), at its end, and at the
  latest `STREAM_LINGER_S` after the oldest token it holds, so a job
  preempted mid-interval does not strand its tokens;
- a non-streaming client's output (every batch line) at most every
  `HOLD_UNSTREAMED_S`, and at its end.

An error's held output goes before the error, whatever the pacing
(deployments/engine.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Protocol, TypeVar

T = TypeVar("T")

# A non-streaming client reads only the whole answer.
HOLD_UNSTREAMED_S = 1.0
# The longest a streaming client's token waits for its interval to fill.
STREAM_LINGER_S = 0.5


class _Delta(Protocol):
    token_ids: list[int]
    finish_reason: str | None


class StreamPacer:
    """Decides, after each batch of deliveries, whether the gathered deltas
    (by choice) go out now; `wait_s` says how long the stream may wait for
    the next delivery before they go anyway."""

    def __init__(self, streamed: bool, interval: int, now: float) -> None:
        if interval < 1:
            raise ValueError(f"stream interval {interval} must be at least 1")
        self.streamed, self.interval = streamed, interval
        self._sent_at = now  # the last item, or the stream's start
        self._held_since: float | None = None  # the oldest gathered delta
        self._started: set[object] = set()  # choices whose first token went

    def due(self, deltas: Mapping[object, _Delta], running: bool, now: float) -> bool:
        if not deltas:
            return False
        if self._held_since is None:
            self._held_since = now
        if not running:
            return True
        if not self.streamed:
            return now - self._sent_at >= HOLD_UNSTREAMED_S
        if self.interval == 1 or now - self._held_since >= STREAM_LINGER_S:
            return True
        return any(d.finish_reason is not None or not d.token_ids
                   or key not in self._started or len(d.token_ids) >= self.interval
                   for key, d in deltas.items())

    def wait_s(self, now: float) -> float | None:
        """None: wait for the next delivery however long it takes."""
        if not self.streamed or self.interval == 1 or self._held_since is None:
            return None
        return max(0.0, self._held_since + STREAM_LINGER_S - now)

    async def next_items(self, q: "asyncio.Queue[T]") -> list[T]:
        """What the queue holds, once it holds something or, with deltas
        held, once their linger time runs out (then maybe nothing)."""
        linger = self.wait_s(time.monotonic())
        if linger is None:
            items = [await q.get()]
        else:
            try:
                items = [await asyncio.wait_for(q.get(), linger)]
            except asyncio.TimeoutError:
                items = []
        while not q.empty():
            items.append(q.get_nowait())
        return items

    def sent(self, deltas: Mapping[object, _Delta], now: float) -> None:
        self._started.update(k for k, d in deltas.items() if d.token_ids)
        self._sent_at, self._held_since = now, None
