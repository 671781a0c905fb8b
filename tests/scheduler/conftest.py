from __future__ import annotations

import itertools

import pytest

from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.job import Job
from scheduler.plan import JobOutput, Plan, StepResult


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class FakeEngine:
    """Samples token `1000 + output_index` for every sampling chunk."""

    def __init__(self, clock: FakeClock, step_time: float = 0.01) -> None:
        self.clock = clock
        self.step_time = step_time

    def execute(self, plan: Plan) -> StepResult:
        self.clock.advance(self.step_time)
        outs = [
            JobOutput(c.job_id, 1000 + c.output_index if c.sample else None)
            for c in plan.chunks
        ]
        return StepResult(plan.step, outs, self.step_time)


_ids = itertools.count()


def make_job(prompt_len: int, max_tokens: int, t: float = 0.0, job_id: str | None = None) -> Job:
    return Job(
        job_id=job_id or f"j{next(_ids)}",
        prompt_token_ids=list(range(1, prompt_len + 1)),
        max_tokens=max_tokens,
        arrival_time=t,
    )


def make_core(clock: FakeClock, **kw) -> SchedulerCore:
    cfg = dict(policy="fcfs", block_size=4, num_blocks=64, max_batch_size=8,
               max_batch_tokens=64, max_model_len=64)
    cfg.update(kw)
    return SchedulerCore(SchedulerConfig(**cfg), clock)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
