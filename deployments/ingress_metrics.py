"""The Ingress's figures in the Ray dashboard (ray.util.metrics): offline
requests at its door (deployments/online_first.py) and requests sent ahead
of their admission answer (deployments/dispatch_ahead.py), sampled once a
second from their counts, never on a request's path; and its requests and
their tokens by the model they named (the base model or a LoRA adapter)
and how they ended, counted as each ends."""

from __future__ import annotations

import asyncio
from typing import Any

from ray.util import metrics

from deployments.dispatch_ahead import DispatchAhead
from deployments.online_first import OnlineFirstDoor

SAMPLE_EVERY_S = 1.0


class IngressMetrics:
    def __init__(self, door: OnlineFirstDoor, ahead: DispatchAhead | None = None) -> None:
        self.door = door
        self.ahead = ahead
        self._ahead_counted = (0, 0)
        self.waiting = metrics.Gauge(
            "ingress_offline_waiting", "Offline requests waiting at the Ingress's door")
        self.starting = metrics.Gauge(
            "ingress_offline_starting",
            "Offline requests starting (admission, the engine stream), door places in use")
        self.requests = metrics.Counter(
            "ingress_requests", "Requests ended, by model (the base model or a LoRA adapter) "
            "and outcome (finished, aborted: the client went away, error)",
            tag_keys=("model", "outcome"))
        self.tokens = metrics.Counter(
            "ingress_tokens", "Prompt and generated tokens of ended requests, by model and kind",
            tag_keys=("model", "kind"))
        self.dispatched_ahead = metrics.Counter(
            "ingress_dispatched_ahead", "Online requests sent to their engine replica beside "
            "their admission call, by outcome (kept; cancelled: refused or placed elsewhere)",
            tag_keys=("outcome",))
        self._task: asyncio.Task[None] | None = None

    def ensure_running(self) -> None:
        """Start sampling in the running event loop (the replica's) on the
        first request: the constructor may run outside it."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._sample())

    def ended(self, model: str, outcome: str, usage: dict[str, Any]) -> None:
        """A request to `model` ended (`usage`: its chat usage object)."""
        self.requests.inc(1, tags={"model": model, "outcome": outcome})
        for kind, key in (("prompt", "prompt_tokens"), ("generated", "completion_tokens")):
            if usage.get(key):
                self.tokens.inc(usage[key], tags={"model": model, "kind": kind})

    def sample(self) -> None:
        self.waiting.set(self.door.offline_waiting)
        self.starting.set(self.door.offline_starting)
        if self.ahead is not None:
            now = (self.ahead.num_kept, self.ahead.num_cancelled)
            for outcome, n, was in zip(("kept", "cancelled"), now, self._ahead_counted):
                if n > was:
                    self.dispatched_ahead.inc(n - was, tags={"outcome": outcome})
            self._ahead_counted = now

    async def _sample(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_EVERY_S)
