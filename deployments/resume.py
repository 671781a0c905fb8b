"""A request's engine stream that outlives its engine replica.

The ingress reads each request's choices from one engine replica.  When
that replica dies mid-generation (its process killed, its node lost) or
stops (a replica Serve lets go), the stream fails; instead of ending the
client's stream with an error, `ResumableStream` asks the Scheduler
deployment for another replica (past admission control: the request was
admitted once) and sends it the request again with, per choice, the tokens
the client already has (`GenerateRequest.resume`).  The new replica treats
each choice as a job preempted mid-generation: it recomputes the KV of the
prompt and those tokens and samples the next one, with the same seeded
stream position, stop conditions and penalties, so the client sees no gap
and no duplicate, and greedy text is that of an uninterrupted run (exactly
so in float32 and in deterministic mode).  Choices that had finished are
not run again.

A replica serving online work may also give an offline request back to
the offline pool (`JobMoved`, scheduler/offline_pool.py): one it has not
started, or one that started and waits with its KV in the application's
host tier but for about one iteration's prefill.  The request then goes
through the pool again (`move`), not counted as a resume; a started one
goes with the tokens its client has, as after a failure, and its new
replica fetches the blocks the old one left in the tier
(`Engine._checkpointed`).

The new replica first asks the application's KV directory how many of
each choice's blocks the failed replica's checkpoints (`survival.checkpoint`,
or ConServe's of offline jobs) left there (`Engine._checkpointed`), fetches
those and recomputes only the tokens past them
(`SchedulerCore.add(host_blocks=)`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from api.protocol import GenerateRequest

log = logging.getLogger(__name__)

# (the replica the request went to, its stream)
Opened = tuple[str | None, Any]
Reopen = Callable[[list[GenerateRequest], str | None], Awaitable[Opened]]

# Times one request may be given back: each time a replica held it waiting
# while another had room; more would mean replicas passing it around.
MAX_MOVES = 8


def replica_failed(e: BaseException) -> bool:
    """Whether `e`, raised by an engine stream, means the replica is gone or
    stopping rather than the request being at fault."""
    from ray.exceptions import RayActorError

    from deployments.delivery import EngineStopped

    return isinstance(e, (RayActorError, EngineStopped))


def job_moved(e: BaseException) -> bool:
    from deployments.delivery import JobMoved

    return isinstance(e, JobMoved)


class ResumableStream:
    def __init__(self, gens: list[GenerateRequest], replica: str | None, stream: Any,
                 reopen: Reopen, max_resumes: int = 3, move: Reopen | None = None) -> None:
        self.gens = gens
        self.replica = replica
        self.stream = stream
        # (gens, the replica that failed) -> the new replica and stream.
        self._reopen = reopen
        # (gens, the replica that gave it back) -> the new replica and stream.
        self._move = move
        self.moves = 0
        self.max_resumes = max_resumes
        self.resumes = 0
        self._outputs: dict[tuple[int, int], list[int]] = {
            (p, i): [] for p, g in enumerate(gens) for i in range(g.n)}
        self._finished: set[tuple[int, int]] = set()
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True
        self.stream.cancel()

    def __aiter__(self) -> AsyncIterator[list[dict[str, Any]]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[list[dict[str, Any]]]:
        while True:
            try:
                async for items in self.stream:
                    for d in items:
                        key = (d.get("prompt", 0), d.get("index", 0))
                        self._outputs[key].extend(d.get("token_ids", ()))
                        if d.get("finish_reason") is not None:
                            self._finished.add(key)
                    yield items
                return
            except Exception as e:
                if (self._move is not None and not self._cancelled and job_moved(e)
                        and self.moves < MAX_MOVES):
                    self.moves += 1
                    log.info("request %s: replica %s gave it back to the offline pool",
                             self.gens[0].request_id, self.replica)
                    # Sent again as it came, or from where its client has it.
                    started = any(self._outputs.values())
                    self.replica, self.stream = await self._move(
                        self.resumed() if started else self.gens, self.replica)
                    continue
                if len(self._finished) == len(self._outputs) and replica_failed(e):
                    return  # the client has every choice whole already
                if self._cancelled or not replica_failed(e) or self.resumes >= self.max_resumes:
                    raise
                self.resumes += 1
                log.warning("request %s: its engine replica %s failed (%r); resuming "
                            "elsewhere (%d)", self.gens[0].request_id, self.replica, e,
                            self.resumes)
                try:
                    self.replica, self.stream = await self._reopen(self.resumed(),
                                                                   self.replica)
                except Exception:
                    log.warning("request %s: could not resume", self.gens[0].request_id,
                                exc_info=True)
                    raise e from None

    def resumed(self) -> list[GenerateRequest]:
        """The request again, each choice from where the client has it."""
        return [g.model_copy(update={"resume": [
            None if (p, i) in self._finished else list(self._outputs[(p, i)])
            for i in range(g.n)]}) for p, g in enumerate(self.gens)]
