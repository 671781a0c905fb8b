"""An engine replica's stream as the ingress reads it: its choice deltas,
with the engine refusing a request told apart from the replica failing, and
the 503 a failure becomes."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from api.errors import APIError


class EngineRefused(Exception):
    """The engine refused the request (its error is the cause)."""


class EngineFailed(Exception):
    """The engine replica failed or went away mid-request (cause attached)."""


def engine_failure(e: "EngineFailed") -> APIError:
    """503 (retry: another replica, or this one once restarted), with the
    replica's reason when it stopped deliberately."""
    from deployments.delivery import EngineStopped

    reason = "the engine serving this request failed or shut down"
    cause = e.__cause__
    if isinstance(cause, EngineStopped):
        # Through Ray the cause is a dual RayTaskError whose first argument
        # is the original exception.
        why: Any = cause
        while isinstance(why, BaseException) and why.args:
            why = why.args[0]
        reason = f"the engine serving this request stopped: " \
                 f"{why if isinstance(why, str) else 'shutting down'}"
    return APIError(503, f"{reason}; retry", type_="service_unavailable")


async def engine_deltas(stream: Any) -> AsyncIterator[dict[str, Any]]:
    """The engine stream's choice deltas, its failures told apart from ours:
    a ValueError is the engine refusing the request; anything else, the
    replica failing."""
    try:
        async for items in stream:
            for d in items:
                yield d
    except ValueError as e:
        raise EngineRefused() from e
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise EngineFailed() from e
