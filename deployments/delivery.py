"""What the engine loop hands the replica's asyncio side for a job after an
iteration (deployments/engine_loop.py): its event, and on its last one its
metrics or the error that ended it."""

from __future__ import annotations

from dataclasses import dataclass

from api.protocol import JobMetrics
from scheduler.core import JobEvent


@dataclass(slots=True)
class Delivery:
    event: JobEvent
    metrics: JobMetrics | None  # set on the job's last event
    error: str | None = None
    # The error is the replica stopping, not the request: the same request
    # may succeed on another replica.
    stopped: bool = False
    # The error is ours (an iteration failed), not a refusal of the request.
    internal: bool = False
    # The replica gave the request back (scheduler/offline_pool.py): the
    # offline pool places it again.
    moved: bool = False


class EngineStopped(RuntimeError):
    """A job ended because its engine replica shut down (not the request's
    fault: retry elsewhere)."""


class JobMoved(RuntimeError):
    """A replica serving online work gave an offline request back to the
    offline pool, which places it where there is room (not a failure:
    nothing of it had run, or what had is in the host tier)."""
