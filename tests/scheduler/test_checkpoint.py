"""Incremental KV checkpointing (ConServe §4.4–§4.5) on a fake clock: which
blocks are copied and when, preemption of a checkpointed job (a discard:
no copy, only the tokens past the checkpoint recomputed), resume by
PREFETCH that keeps the host copy, and the host tier's accounting."""

from __future__ import annotations

import pytest

from scheduler.checkpoint import jobs_to_cover
from scheduler.core import SchedulerCore
from scheduler.job import Job, JobClass
from scheduler.plan import BlockOpKind, Plan, StepResult
from tests.scheduler.conftest import FakeClock, FakeEngine, drain, make_job, per_block
from tests.scheduler.test_conserve import add_offline, core_for, offline, step


def ops(plan: Plan, kind: BlockOpKind) -> list[tuple[str, int]]:
    return [(op.job_id, i) for op, i, _ in per_block(plan.block_ops) if op.kind is kind]


def ckpt_core(clock: FakeClock, prefix_caching: bool = True, **conserve) -> SchedulerCore:
    """16 blocks of 4 tokens, a host tier of 64 blocks, checkpointing from
    the first block in use."""
    conserve = {"tpot_slo_s": 0.05, "checkpoint_threshold": 0.0, **conserve}
    return core_for(clock, num_blocks=16, max_model_len=40, swap_mode="recompute",
                    host_kv_blocks=64, conserve=conserve, prefix_caching=prefix_caching)


def finish(core: SchedulerCore, engine: FakeEngine) -> list[Plan]:
    """Drain, then run the plan that carries the last host-copy drops."""
    plans = drain(core, engine)
    if core.swap.pending_ops:
        plans.append(step(core, engine)[0])
    return plans


def expected_outputs(job: Job) -> list[int]:
    return [1000 + i for i in range(job.max_tokens)]


def test_share_of_jobs_covered_grows_with_memory_use() -> None:
    assert jobs_to_cover(8, 0.49, 0.5) == 0
    assert jobs_to_cover(8, 0.5, 0.5) == 1  # one job at the threshold
    assert jobs_to_cover(8, 0.75, 0.5) == 4
    assert jobs_to_cover(8, 1.0, 0.5) == 8
    assert jobs_to_cover(0, 1.0, 0.5) == 0
    assert jobs_to_cover(3, 0.2, 0.0) == 1


def test_only_full_computed_blocks_are_copied_once_each(clock: FakeClock) -> None:
    core = ckpt_core(clock)
    engine = FakeEngine(clock)
    job = offline(6, 12)
    core.add(job)
    copied: list[tuple[str, int]] = []
    for _ in range(8):
        computed = job.num_computed_tokens
        plan, _ = step(core, engine)
        got = ops(plan, BlockOpKind.CHECKPOINT)
        # Each copied block was full and computed when the plan was made.
        assert all((idx + 1) * 4 <= computed for _, idx in got)
        copied += got
    assert len(copied) == len(set(copied)), "a block was checkpointed twice"
    assert [i for _, i in copied] == list(range(len(copied)))
    assert job.num_checkpointed_blocks == len(copied) >= 2
    assert core.swap.host_used == job.num_checkpointed_blocks
    # The device blocks stay in use: checkpointing frees nothing.
    assert len(job.block_table) * 4 >= job.num_computed_tokens
    finish(core, engine)
    assert job.output_token_ids == expected_outputs(job)
    assert core.swap.host_used == 0 and not engine.host, "the finished job's copy was kept"


def test_nothing_is_copied_below_the_threshold(clock: FakeClock) -> None:
    core = ckpt_core(clock, checkpoint_threshold=0.9)
    engine = FakeEngine(clock)
    core.add(offline(8, 8))
    plans = finish(core, engine)
    assert not any(ops(p, BlockOpKind.CHECKPOINT) for p in plans)


def test_checkpointing_off_or_without_a_host_tier_copies_nothing(clock: FakeClock) -> None:
    for core in (ckpt_core(clock, checkpoint=False),
                 core_for(clock, num_blocks=16, max_model_len=40,
                          conserve={"checkpoint_threshold": 0.0})):
        engine = FakeEngine(clock)
        core.add(offline(8, 8))
        assert not any(ops(p, BlockOpKind.CHECKPOINT) for p in finish(core, engine))


def test_copies_per_iteration_stay_within_the_budget(clock: FakeClock) -> None:
    core = ckpt_core(clock, checkpoint_max_blocks=2)
    engine = FakeEngine(clock)
    add_offline(core, engine, 3, 12, 4)
    plans = finish(core, engine)
    per_plan = [len(ops(p, BlockOpKind.CHECKPOINT)) for p in plans]
    assert max(per_plan) == 2
    # The blocks left over went in later iterations.
    assert sum(per_plan) >= 6


def test_host_capacity_bounds_checkpoints(clock: FakeClock) -> None:
    core = core_for(clock, num_blocks=16, max_model_len=40, host_kv_blocks=3,
                    conserve={"checkpoint_threshold": 0.0})
    engine = FakeEngine(clock)
    jobs = add_offline(core, engine, 2, 12, 8)
    for _ in range(6):
        step(core, engine)
        assert core.swap.host_used <= 3
    assert sum(j.num_checkpointed_blocks for j in jobs) == 3
    finish(core, engine)
    assert all(j.output_token_ids == expected_outputs(j) for j in jobs)


def test_preempting_a_checkpointed_job_copies_nothing(clock: FakeClock) -> None:
    """KV full of offline work; an online job arrives: the checkpointed
    victim's blocks are freed in the same plan with no SWAP_OUT, it resumes
    by PREFETCH that keeps the host copy, recomputes only the tokens past
    its checkpoint, and every job's tokens and KV come out intact."""
    core = ckpt_core(clock)
    engine = FakeEngine(clock)
    offs = add_offline(core, engine, 4, 12, 12, steps=3)
    assert core.blocks.num_free < 4
    assert any(j.num_checkpointed_blocks for j in offs)
    on = make_job(16, 4, clock.t)
    core.add(on)
    plan, _ = step(core, engine)
    assert plan.chunks[0].job_id == on.job_id
    assert plan.preempted
    assert not ops(plan, BlockOpKind.SWAP_OUT)
    victims = [core.jobs[j] for j in plan.preempted]
    for v in victims:
        assert v.job_class is JobClass.OFFLINE
        assert v.num_checkpointed_blocks, "an uncheckpointed job went first"
        assert v.num_host_blocks == v.num_checkpointed_blocks
        assert v.num_computed_tokens == 4 * v.num_checkpointed_blocks
        assert not v.block_table
    assert core.swap.num_checkpoint_discards == len(victims)
    plans = finish(core, engine)
    resumed = {v.job_id for v in victims}
    prefetched = {j for p in plans for j, _ in ops(p, BlockOpKind.PREFETCH)}
    assert resumed <= prefetched
    assert not any(ops(p, BlockOpKind.SWAP_IN) for p in plans)
    for j in [*offs, on]:
        assert j.output_token_ids == expected_outputs(j), j.job_id
    assert core.swap.host_used == 0 and not engine.host
    core.blocks.check([])


def _checkpointed_offline_job(core: SchedulerCore, clock: FakeClock
                              ) -> tuple[FakeEngine, Job, int]:
    """An offline job run four steps, with at least two blocks checkpointed."""
    engine = FakeEngine(clock)
    job = offline(8, 20)
    core.add(job)
    for _ in range(4):
        step(core, engine)
    assert job.num_checkpointed_blocks >= 2
    return engine, job, job.num_checkpointed_blocks


def test_a_resumed_job_keeps_its_checkpoint(clock: FakeClock) -> None:
    """Preempted twice: the second discard needs no copy of what the first
    checkpoint held, and the blocks it restores are the ones it wrote.
    (Without the prefix cache, which would give its blocks back without a
    copy: the next test.)"""
    core = ckpt_core(clock, prefix_caching=False)
    engine, job, k = _checkpointed_offline_job(core, clock)
    first: list[tuple[str, int]] = []
    for round_ in range(2):
        plan = Plan(step=0)
        core.policy.remove(job)
        core.policy.evict(job, plan.block_ops)
        core.policy.add(job)
        assert not plan.block_ops, "a discard copies nothing"
        assert job.num_host_blocks == job.num_checkpointed_blocks
        plan, _ = step(core, engine)
        fetched = ops(plan, BlockOpKind.PREFETCH)
        assert len(fetched) == job.num_checkpointed_blocks
        if round_ == 0:
            first = fetched
        else:
            assert fetched[:len(first)] == first
        while not job.is_resident:
            step(core, engine)
        assert job.num_checkpointed_blocks >= k
        assert core.swap.host_used == job.num_checkpointed_blocks
        step(core, engine)
    finish(core, engine)
    assert job.output_token_ids == expected_outputs(job)
    assert core.swap.host_used == 0


@pytest.mark.parametrize("swap_delay", [0, 3])
def test_abort_while_a_prefetch_is_in_flight_leaks_nothing(clock: FakeClock,
                                                           swap_delay: int) -> None:
    core = ckpt_core(clock, prefix_caching=False)  # so that its blocks are fetched
    engine = FakeEngine(clock, swap_delay=swap_delay)
    job = offline(8, 20)
    core.add(job)
    for _ in range(4):
        step(core, engine)
    core.policy.remove(job)
    core.policy.evict(job, [])
    core.policy.add(job)
    plan, _ = step(core, engine)
    assert ops(plan, BlockOpKind.PREFETCH)
    core.abort(job.job_id)
    plan, _ = step(core, engine)
    assert ops(plan, BlockOpKind.DROP) == [(job.job_id, -1)]
    assert core.swap.host_used == 0 and not engine.host
    core.blocks.check(core.jobs.values())
    assert core.blocks.num_free == 16


def test_a_discarded_job_takes_back_its_blocks_still_on_the_device(clock: FakeClock) -> None:
    """A discard to the checkpoint frees the job's blocks, and the prefix
    cache keeps those it indexed: brought back before anything reused them,
    the job takes them as they are, copies nothing, and keeps its
    checkpoint; the tokens stay the run's."""
    core = ckpt_core(clock)
    engine, job, k = _checkpointed_offline_job(core, clock)
    plan = Plan(step=0)
    core.policy.remove(job)
    core.policy.evict(job, plan.block_ops)
    core.policy.add(job)
    assert job.num_host_blocks == k and not job.block_table
    plan, _ = step(core, engine)
    assert not ops(plan, BlockOpKind.PREFETCH)
    assert core.swap.blocks_kept == k and job.is_resident
    assert job.num_checkpointed_blocks >= k and core.swap.host_used == job.num_checkpointed_blocks
    finish(core, engine)
    assert job.output_token_ids == expected_outputs(job)
    assert core.swap.host_used == 0

def test_an_iteration_checkpoints_what_the_link_copies_while_it_computes(
        clock: FakeClock) -> None:
    """ConServe §4.5's I/O budget: the measured copy rate times the last
    iteration's time, under the configured cap."""
    core = ckpt_core(clock, checkpoint_max_blocks=32)
    swap = core.swap
    assert swap.copies_per_iteration(32) == 32  # nothing measured yet
    plan = core.schedule()
    core.complete(plan, StepResult(plan.step, [], 0.02, copy_rate=250.0))
    assert (swap.copy_rate, swap.iteration_time) == (250.0, 0.02)
    assert swap.copies_per_iteration(32) == 5 and swap.copies_per_iteration(3) == 3
    # 100 blocks/s over the fake engine's 10 ms iterations: one block each,
    # where the cap alone lets a plan copy several.
    def most_per_plan(rate: float | None) -> int:
        core = ckpt_core(clock, checkpoint_max_blocks=32)
        core.swap.copy_rate = rate
        engine = FakeEngine(clock)
        add_offline(core, engine, 3, 12, 4)
        return max(len(ops(p, BlockOpKind.CHECKPOINT)) for p in finish(core, engine))

    assert most_per_plan(100.0) == 1
    assert most_per_plan(None) > 1


@pytest.mark.parametrize("preempted", [True, False])
def test_a_started_offline_job_moves_to_another_replica_through_the_host_tier(
        clock: FakeClock, preempted: bool) -> None:
    """A replica gives a started offline job back (scheduler/offline_pool.py):
    its host copy stays in the shared tier (`abort(keep_host=True)`: no
    DROP), and another replica adopts it, fetches those blocks, recomputes
    only the rest and ends with the uninterrupted run's tokens.  Preempted
    back to its checkpoint, or resident with every block but its last
    copied."""
    from scheduler.offline_pool import movable_offline

    here, there = ckpt_core(clock), ckpt_core(clock)
    engine_here, engine_there = FakeEngine(clock), FakeEngine(clock)
    engine_there.host = engine_here.host  # one tier, as the object store is
    job = offline(9, 12)
    here.add(job)
    while not (job.num_checkpointed_blocks >= 3 and job.output_token_ids
               and len(job.block_table) - job.num_checkpointed_blocks <= 1):
        step(here, engine_here)
    if preempted:
        here.policy.remove(job)
        here.policy.evict(job, [])
        here.policy.add(job)
        assert not job.block_table and job.num_host_blocks
    groups = {job.job_id: [job.job_id]}
    assert movable_offline(groups, here.jobs, (), 1, recompute_blocks=1) == [job.job_id]
    copied = job.num_checkpointed_blocks
    outputs = list(job.output_token_ids)
    here.abort(job.job_id, keep_host=True)
    assert not ops(here.schedule(), BlockOpKind.DROP)
    assert here.swap.host_used == 0 and here.blocks.num_free == here.blocks.num_blocks
    assert sorted(i for j, i in engine_here.host if j == job.job_id) == list(range(copied))

    again = Job(job.job_id, list(job.prompt_token_ids), max_tokens=job.max_tokens,
                arrival_time=clock(), job_class=JobClass.OFFLINE)
    again.output_token_ids = outputs  # what its client has
    there.add(again, host_blocks=copied)
    assert again.num_computed_tokens == copied * 4
    plans = finish(there, engine_there)
    fetched = [op for p in plans for op in p.block_ops if op.kind is BlockOpKind.PREFETCH]
    assert sorted(i for op in fetched for i in op.block_indices) == list(range(copied))
    # Computed there: only what lies past the copied blocks.
    first = next(c for p in plans for c in p.chunks if c.job_id == again.job_id)
    assert first.start_pos == copied * 4
    assert again.output_token_ids == expected_outputs(again)
    assert there.swap.host_used == 0 and not engine_here.host  # dropped where it ended
