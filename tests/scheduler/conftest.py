from __future__ import annotations

import itertools

import pytest

from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.job import Job
from scheduler.plan import BlockOpKind, JobOutput, Plan, StepResult


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class FakeEngine:
    """Samples token `1000 + output_index` for every sampling chunk.

    Keeps a fake KV store: each device block holds the id of the job that
    wrote it, so a test can tell that swapped blocks came back intact.
    Swap-ins land `swap_delay` steps after they were issued.
    """

    def __init__(self, clock: FakeClock, step_time: float = 0.01, swap_delay: int = 0) -> None:
        self.clock = clock
        self.step_time = step_time
        self.swap_delay = swap_delay
        self.device: dict[int, tuple[str, int]] = {}
        self.host: dict[tuple[str, int], tuple[str, int]] = {}
        self.in_flight: list[tuple[int, str]] = []
        self.swapped_in_blocks = 0
        self.swapped_out_blocks = 0
        self._step = 0

    def execute(self, plan: Plan) -> StepResult:
        self._step += 1
        landed_now: list[str] = []
        for op in plan.block_ops:
            if op.kind is BlockOpKind.SWAP_OUT:
                self.host[(op.job_id, op.block_index)] = self.device[op.device_block]
                self.swapped_out_blocks += 1
            elif op.kind is BlockOpKind.SWAP_IN:
                self.device[op.device_block] = self.host.pop((op.job_id, op.block_index))
                self.swapped_in_blocks += 1
                if op.block_index == 0:
                    self.in_flight.append((self._step + self.swap_delay, op.job_id))
            elif op.kind is BlockOpKind.DROP:
                for k in [k for k in self.host if k[0] == op.job_id]:
                    del self.host[k]
        for c in plan.chunks:
            bs = 4
            for pos in range(c.start_pos, c.start_pos + c.num_tokens):
                if pos % bs == 0:
                    self.device[c.block_table[pos // bs]] = (c.job_id, pos // bs)
            for idx in range((c.start_pos + c.num_tokens + bs - 1) // bs):
                assert self.device.get(c.block_table[idx]) == (c.job_id, idx), (
                    f"{c.job_id} block {idx} holds {self.device.get(c.block_table[idx])}")
        done = [j for t, j in self.in_flight if t <= self._step]
        self.in_flight = [(t, j) for t, j in self.in_flight if t > self._step]
        landed_now += done
        self.clock.advance(self.step_time)
        outs = [
            JobOutput(c.job_id, 1000 + c.output_index if c.sample else None)
            for c in plan.chunks
        ]
        return StepResult(plan.step, outs, self.step_time, swaps_in_done=landed_now)


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
