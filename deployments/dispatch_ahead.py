"""An online request sent to its engine replica while its admission is asked.

An idle server's first token waits for two calls in turn: the ingress asks
the Scheduler deployment where the request may run (admission control and
placement, a round trip of a few milliseconds), and only then sends it to that
engine replica. Where the answer can be foreseen, both go at once: the
Scheduler's answer to each admission says whether the application has a
single live engine replica that starts a newcomer at once (a free batch
slot, no prompt waiting: `ReplicaLoad.starts_at_once`), and while that last
answer holds, the ingress sends its next online request to that replica
beside the admission call. Admitted there, the stream goes on; refused, or
placed elsewhere, the early call is cancelled (the engine aborts the job and
frees its blocks, as for a client gone) and the request takes its answer's
path. A refusal answer turns the guess off until an answer says room again.

One such request at a time per ingress: a burst that finds the guess stale
sends at most one job the Scheduler may refuse, which the engine drops
within one admission round trip.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from api.admission_wire import Admission


class DispatchAhead:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        # The replica the last admission answer named as sole and open.
        self.replica: str | None = None
        self._in_flight = False
        # Early calls kept or cancelled after the answer (the
        # `ingress_dispatched_ahead` metric, tests).
        self.num_kept = 0
        self.num_cancelled = 0

    def claim(self, online: bool) -> str | None:
        """The replica to send an online request to now, before its
        admission answer; None: wait for the answer."""
        if not (self.enabled and online) or self.replica is None or self._in_flight:
            return None
        self._in_flight = True
        return self.replica

    def learn(self, adm: Admission) -> None:
        """Each admission answer of this ingress's calls."""
        self.replica = adm.dispatch_ahead if adm.admitted else None

    async def open(self, online: bool, admit: Callable[[], Awaitable[str | None]],
                   send: Callable[[str | None, bool], Any]) -> tuple[str | None, Any]:
        """Admit a request (`admit()`: the replica it may run on; raises when
        refused) and open its engine stream (`send(replica, fresh)`), beside
        the admission call where the last answer foresaw the replica.  A
        stream opened again after an early one was cancelled goes out of
        the request's Serve context (`fresh`): Serve's router would never
        route a second call under the request's id while the first is still
        being routed (Ingress._detached)."""
        ahead = self.claim(online)
        if ahead is None:
            replica = await admit()
            return replica, send(replica, False)
        early = send(ahead, False)
        kept = False
        try:
            answered = await admit()
            kept = answered == ahead
        finally:
            self._in_flight = False
            if kept:
                self.num_kept += 1
            else:
                self.num_cancelled += 1
                early.cancel()
        return answered, early if kept else send(answered, True)
