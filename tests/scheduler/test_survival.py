"""Checkpoints of every running job (`survival.checkpoint`) and a job that
arrives with its KV already in the host tier (`SchedulerCore.add(...,
host_blocks=)`), on a fake clock with fake results."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.job import Job
from scheduler.plan import BlockOpKind, JobOutput, Plan, StepResult
from tests.scheduler.conftest import per_block


def core(policy: str = "fcfs", **survival: object) -> SchedulerCore:
    cfg = SchedulerConfig(policy=policy, block_size=4, num_blocks=64, max_batch_size=8,
                          max_batch_tokens=64, max_model_len=128, host_kv_blocks=100,
                          survival={"checkpoint": True, **survival})
    return SchedulerCore(cfg, clock=lambda: 0.0)


def run(c: SchedulerCore, plan: Plan, landed: tuple[str, ...] = ()) -> None:
    c.complete(plan, StepResult(plan.step, [JobOutput(ch.job_id, 5 if ch.sample else None)
                                            for ch in plan.chunks], 0.01,
                                swaps_in_done=list(landed)))


def ops(plan: Plan, kind: BlockOpKind) -> list[tuple[str, int]]:
    return [(op.job_id, i) for op, i, _ in per_block(plan.block_ops) if op.kind is kind]


@pytest.mark.parametrize("policy", ["fcfs", "mlfq"])
def test_running_jobs_are_copied_every_few_full_blocks(policy: str) -> None:
    c = core(policy, every_blocks=2, max_blocks_per_iteration=3)
    c.add(Job("a", [7] * 18, max_tokens=30, arrival_time=0.0))  # 4 full blocks once prefilled
    first = c.schedule()
    assert not ops(first, BlockOpKind.CHECKPOINT)  # nothing computed yet
    run(c, first)
    copied: list[tuple[str, int]] = []
    for _ in range(12):
        plan = c.schedule()
        copied += ops(plan, BlockOpKind.CHECKPOINT)
        run(c, plan)
    # Three blocks in the first iteration (the budget), then two at a time
    # once two full ones wait: 3 and 4 at 20 computed tokens, 5 and 6 at 28
    # (the last plan sees 29 computed).
    assert copied == [("a", i) for i in range(7)]
    assert c.jobs["a"].num_checkpointed_blocks == 7
    assert c.swap.host_used == 7


def test_a_job_resumes_from_blocks_already_in_the_host_tier() -> None:
    c = core()
    job = Job("r", [7] * 30, max_tokens=10, arrival_time=0.0)
    job.output_token_ids = [5, 5, 5]  # 33 tokens, as re-admitted after a failure
    c.add(job, host_blocks=5)
    assert job.num_computed_tokens == 20 and c.swap.host_used == 5
    fetch = c.schedule()
    assert not fetch.chunks
    assert ops(fetch, BlockOpKind.PREFETCH) == [("r", i) for i in range(5)]
    run(c, fetch, landed=("r",))
    tail = c.schedule()
    (chunk,) = tail.chunks
    assert (chunk.start_pos, chunk.num_tokens, chunk.sample, chunk.output_index) == (
        20, 13, True, 3)
    assert not ops(tail, BlockOpKind.PREFETCH)
    run(c, tail)
    assert job.output_token_ids == [5, 5, 5, 5]
    # Finished or aborted, its host copy is dropped like any other.
    c.abort("r")
    assert ops(c.schedule(), BlockOpKind.DROP) == [("r", -1)]
    assert c.swap.host_used == 0 and c.blocks.num_free == c.blocks.num_blocks


def test_resumed_blocks_never_cover_the_last_token() -> None:
    c = core()
    job = Job("r", [7] * 30, max_tokens=10, arrival_time=0.0)
    job.output_token_ids = [5, 5, 5]
    c.add(job, host_blocks=20)  # a stale count: at most (33 - 1) // 4 = 8
    assert job.num_checkpointed_blocks == 8 and job.num_computed_tokens == 32
    shared = Job("s", [7] * 30, max_tokens=10, arrival_time=0.0)
    with pytest.raises(ValueError, match="cannot both share a prompt and resume KV"):
        c.add(shared, share_prompt_with="r", host_blocks=2)


def test_survival_checkpoints_need_a_host_tier() -> None:
    with pytest.raises(ValidationError, match="host_kv_tokens above 0"):
        SchedulerConfig(num_blocks=64, block_size=4, max_model_len=128,
                        survival={"checkpoint": True})


def test_exposure_is_the_tokens_past_each_resident_jobs_checkpoint() -> None:
    from scheduler.checkpoint import exposure

    c = core(every_blocks=2, max_blocks_per_iteration=1)
    c.add(Job("a", [7] * 18, max_tokens=30, arrival_time=0.0))
    c.add(Job("b", [8] * 9, max_tokens=30, arrival_time=0.0))
    assert exposure(c.jobs.values(), 4) == (0, 0, 0)  # nothing computed, nothing held
    run(c, c.schedule())
    # Prefilled, nothing copied yet: every computed token is exposed.
    assert exposure(c.jobs.values(), 4) == (2, 27, 18)
    for _ in range(3):  # one block copied an iteration (the budget), a's first
        run(c, c.schedule())
    a, b = c.jobs["a"], c.jobs["b"]
    assert (a.num_checkpointed_blocks, b.num_checkpointed_blocks) == (3, 0)
    # a: 21 computed, 12 copied; b: 12 computed, none copied.
    assert exposure(c.jobs.values(), 4) == (2, 9 + 12, 12)
    # Without checkpoints a resident job's every computed token is exposed.
    off = SchedulerCore(SchedulerConfig(**{**c.config.model_dump(), "survival": {}}),
                        clock=lambda: 0.0)
    off.add(Job("c", [7] * 10, max_tokens=5, arrival_time=0.0))
    run(off, off.schedule())
    assert exposure(off.jobs.values(), 4) == (1, 10, 10)
