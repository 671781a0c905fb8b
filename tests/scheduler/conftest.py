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
    wrote it, so a test can tell that swapped blocks came back intact.  A
    sibling registered with `share_prompt` may also read the full prompt
    blocks that another job of its group wrote (same tokens, same KV).
    Checkpoints copy a block's label to the host and leave it on the device.
    Swap-ins and prefetches land `swap_delay` steps after they were issued.
    """

    block_size = 4

    def __init__(self, clock: FakeClock, step_time: float = 0.01, swap_delay: int = 0) -> None:
        self.clock = clock
        self.step_time = step_time
        self.swap_delay = swap_delay
        self.device: dict[int, tuple[str, int]] = {}
        self.host: dict[tuple[str, int], tuple[str, int]] = {}
        self.in_flight: list[tuple[int, str]] = []
        self.swapped_in_blocks = 0
        self.swapped_out_blocks = 0
        self.checkpointed_blocks = 0
        self._group: dict[str, str] = {}
        self._group_prompt_len: dict[str, int] = {}
        self._step = 0

    def share_prompt(self, sibling: str, leader: str, prompt_len: int) -> None:
        group = self._group.setdefault(leader, leader)
        self._group[sibling] = group
        self._group_prompt_len[group] = prompt_len

    def _holds(self, job_id: str, idx: int, label: tuple[str, int] | None) -> bool:
        if label == (job_id, idx):
            return True
        group = self._group.get(job_id)
        return (group is not None and label is not None and label[1] == idx
                and self._group.get(label[0]) == group
                and (idx + 1) * self.block_size <= self._group_prompt_len[group])

    def execute(self, plan: Plan) -> StepResult:
        self._step += 1
        landed_now: list[str] = []
        for op in plan.block_ops:
            if op.kind in (BlockOpKind.SWAP_OUT, BlockOpKind.CHECKPOINT):
                self.host[(op.job_id, op.block_index)] = self.device[op.device_block]
                if op.kind is BlockOpKind.SWAP_OUT:
                    self.swapped_out_blocks += 1
                else:
                    self.checkpointed_blocks += 1
            elif op.kind in (BlockOpKind.SWAP_IN, BlockOpKind.PREFETCH):
                key = (op.job_id, op.block_index)
                # A prefetch restores a checkpoint and keeps it.
                self.device[op.device_block] = (self.host.pop(key) if op.kind is
                                                BlockOpKind.SWAP_IN else self.host[key])
                self.swapped_in_blocks += 1
                if op.block_index == 0:
                    self.in_flight.append((self._step + self.swap_delay, op.job_id))
            elif op.kind is BlockOpKind.DROP:
                for k in [k for k in self.host if k[0] == op.job_id]:
                    del self.host[k]
        for c in plan.chunks:
            bs = self.block_size
            for pos in range(c.start_pos, c.start_pos + c.num_tokens):
                if pos % bs == 0:
                    self.device[c.block_table[pos // bs]] = (c.job_id, pos // bs)
            for idx in range((c.start_pos + c.num_tokens + bs - 1) // bs):
                label = self.device.get(c.block_table[idx])
                assert self._holds(c.job_id, idx, label), f"{c.job_id} block {idx} holds {label}"
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


def make_job(prompt_len: int, max_tokens: int, t: float = 0.0, job_id: str | None = None,
             priority: int = 0) -> Job:
    return Job(
        job_id=job_id or f"j{next(_ids)}",
        prompt_token_ids=list(range(1, prompt_len + 1)),
        max_tokens=max_tokens,
        arrival_time=t,
        priority=priority,
    )


def make_core(clock: FakeClock, **kw) -> SchedulerCore:
    cfg = dict(policy="fcfs", block_size=4, num_blocks=64, max_batch_size=8,
               max_batch_tokens=64, max_model_len=64)
    cfg.update(kw)
    return SchedulerCore(SchedulerConfig(**cfg), clock)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def add_siblings(core: SchedulerCore, engine: FakeEngine, leader: Job, n: int,
                 max_tokens: int | None = None, priority: int = 0) -> list[Job]:
    """Add `n` more completions of `leader`'s request, sharing its prompt."""
    out = []
    for i in range(n):
        s = Job(f"{leader.job_id}.{i + 1}", list(leader.prompt_token_ids),
                max_tokens if max_tokens is not None else leader.max_tokens,
                leader.arrival_time, priority=priority)
        engine.share_prompt(s.job_id, leader.job_id, leader.num_prompt_tokens)
        core.add(s, share_prompt_with=leader.job_id)
        out.append(s)
    return out


def step(core: SchedulerCore, engine: FakeEngine) -> Plan:
    plan = core.schedule()
    core.complete(plan, engine.execute(plan))
    core.blocks.check(core.jobs.values())
    return plan


def drain(core: SchedulerCore, engine: FakeEngine, max_steps: int = 10_000) -> list[Plan]:
    plans = []
    while core.has_work:
        plans.append(step(core, engine))
        assert len(plans) < max_steps, "scheduler did not drain"
    return plans
