"""Fakes of what batches talk to: the Ray Jobs API and a batch's sender."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from api.batch import BatchResponse
from api.errors import APIError
from batch.jobs import JobsUnavailable, JobView


@dataclass
class FakeJobs:
    """Ray Jobs for the batch routes: a submitted job is RUNNING until a
    test sets another status; `down` makes the API unreachable."""

    submitted: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    status: dict[str, str] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    down: bool = False

    def _check(self) -> None:
        if self.down:
            raise JobsUnavailable("the Ray Jobs API at test cannot be reached")

    def check(self) -> None:
        self._check()

    def submit(self, submission_id: str, entrypoint: str, metadata: dict[str, str]) -> None:
        self._check()
        self.submitted.append((submission_id, entrypoint, metadata))
        self.status[submission_id] = "RUNNING"

    def info(self, submission_id: str) -> JobView | None:
        self._check()
        if submission_id not in self.status:
            return None
        return JobView(submission_id=submission_id, status=self.status[submission_id],
                       message="job message", start_time=1_000_000, end_time=2_000_000)

    def infos(self) -> dict[str, JobView]:
        self._check()
        return {s: v for s in self.status if (v := self.info(s)) is not None}

    def stop(self, submission_id: str) -> None:
        self._check()
        self.stopped.append(submission_id)
        self.status[submission_id] = "STOPPED"


@dataclass
class FakeSender:
    """`send(url, body)` answering as `Ingress.batch_request` does: a 200
    completion whose text echoes the prompt, a 400 for `max_tokens: 0` (as
    validation refuses it); `script[prompt]`: statuses (or "raise", a lost
    replica) to answer that prompt with first."""

    delay_s: float = 0.0
    script: dict[str, list[int | str]] = field(default_factory=dict)
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    async def __call__(self, url: str, body: dict[str, Any]) -> BatchResponse:
        self.calls.append((url, dict(body)))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            prompt = str(body.get("prompt"))
            if self.script.get(prompt):
                what = self.script[prompt].pop(0)
                if what == "raise":
                    raise RuntimeError("the replica died")
                return BatchResponse(status_code=int(what), body=APIError(
                    int(what), "not now", type_="service_unavailable").body())
            if body.get("max_tokens") == 0:
                return BatchResponse(status_code=400, body=APIError(
                    400, "max_tokens: Input should be greater than 0", "max_tokens").body())
            rid = f"cmpl-{len(self.calls)}"
            return BatchResponse(status_code=200, request_id=rid, body={
                "id": rid, "object": "text_completion",
                "choices": [{"index": 0, "text": f"echo: {prompt}", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}})
        finally:
            self.in_flight -= 1

    def sent_ids(self) -> list[str]:
        """The custom ids of the lines sent, one per call (prompts are
        `prompt <custom id>`)."""
        return [str(b.get("prompt")).removeprefix("prompt ") for _, b in self.calls]
