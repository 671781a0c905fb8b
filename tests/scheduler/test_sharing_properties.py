"""Random add (shared or not) / abort / step sequences on small block pools:
the block accounting holds after every step, no chunk ever writes a block
another job holds, shared blocks cover only computed full prompt blocks, and
everything is freed at the end.  Prompts of one family begin with the same
three blocks, which later ones find in the prefix cache (held by a live job
or parked), and every position read holds its job's own tokens' KV
(`FakeEngine`)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from scheduler.config import MLFQConfig, SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.job import Job, JobState
from scheduler.plan import Plan
from tests.scheduler.conftest import FakeClock, FakeEngine

BS = FakeEngine.block_size

# Jobs of at most 32 tokens (8 blocks) in pools of 16 to 20 blocks: any two
# fit together.  Two jobs that do not can make FCFS's swap-ins evict each
# other forever, sharing or not (the one whose copy landed cannot grow while
# the other's is in flight, so it evicts itself): a limit of FCFS with a
# cache that small, not what this test is about.  Long prompts are drawn
# often, and answers of up to 16 tokens grow jobs into each other's memory,
# so that most examples preempt (and the search steers towards more
# preemptions, `target`).
# ("add", prompt length, max tokens, share with the n-th live job, priority,
#  prefix family)
_add = st.integers(4, 16).flatmap(lambda max_tokens: st.tuples(
    st.just("add"), st.integers(1, 32 - max_tokens) | st.integers(16, 32 - max_tokens),
    st.just(max_tokens), st.one_of(st.none(), st.integers(0, 50)), st.integers(0, 2),
    st.sampled_from([None, 0, 0, 1])))
FAMILY_PREFIX = 3 * BS
_abort = st.tuples(st.just("abort"), st.integers(0, 50))
_step = st.tuples(st.just("step"), st.integers(1, 4))
# A burst of arrivals first, so that memory runs short.
_ops = st.builds(lambda burst, rest: burst + rest, st.lists(_add, min_size=3, max_size=8),
                 st.lists(st.one_of(_add, _add, _abort, _step, _step), max_size=40))


def check_writes(core: SchedulerCore, plan: Plan) -> None:
    """Every position a chunk computes lies in a block only its job holds."""
    for c in plan.chunks:
        job = core.jobs[c.job_id]
        assert c.block_table == job.block_table
        end = c.start_pos + c.num_tokens
        for idx in range(c.start_pos // BS, -(-end // BS)):
            assert core.blocks.holders(c.block_table[idx]) == {c.job_id}, (
                f"{c.job_id} writes positions of block {idx} that others hold")


def check_state(core: SchedulerCore) -> None:
    """Block accounting agrees with the block tables; a shared block holds
    full positions its holders have computed; held siblings hold nothing;
    every job is counted once in the stats."""
    core.blocks.check(core.jobs.values())
    for job in core.jobs.values():
        for idx, b in enumerate(job.block_table):
            if core.blocks.num_holders(b) > 1:
                assert (idx + 1) * BS <= job.num_computed_tokens
        if core.sharing.is_held(job):
            assert not job.block_table and job.state is JobState.WAITING
    stats = core.stats()
    assert stats.num_waiting + stats.num_running == len(core.jobs)


def run_step(core: SchedulerCore, engine: FakeEngine) -> None:
    plan = core.schedule()
    check_writes(core, plan)
    core.complete(plan, engine.execute(plan))
    check_state(core)


@pytest.mark.parametrize("mode", ["recompute", "reactive", "proactive"])
@pytest.mark.parametrize("policy", ["fcfs", "mlfq"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, num_blocks=st.integers(16, 20), batch=st.integers(2, 4),
       tokens=st.sampled_from([4, 9, 32]), host=st.sampled_from([4, 64]),
       swap_delay=st.sampled_from([0, 2]))
def test_random_sharing_keeps_blocks_consistent(
    policy: str, mode: str, ops: list[tuple], num_blocks: int, batch: int,
    tokens: int, host: int, swap_delay: int,
) -> None:
    core = run_ops(policy, mode, ops, num_blocks, batch, tokens, host, swap_delay)
    event(f"shared: {core.stats().num_shared_prompt_tokens > 0}")
    event(f"prefix cache hit: {core.stats().num_prefix_hit_tokens > 0}")
    event(f"preempted: {core.num_preemptions > 0}")
    target(float(core.num_preemptions), label="preemptions")


def run_ops(policy: str, mode: str, ops: list[tuple], num_blocks: int, batch: int,
            tokens: int, host: int, swap_delay: int) -> SchedulerCore:
    clock = FakeClock()
    core = SchedulerCore(SchedulerConfig(
        policy=policy, block_size=BS, num_blocks=num_blocks, max_batch_size=batch,
        max_batch_tokens=tokens, max_model_len=64, swap_mode=mode,
        host_kv_blocks=0 if mode == "recompute" else host,
        # α of 90 iterations: any one job finishes within it, so promotion
        # cannot make two long jobs evict each other forever.
        mlfq=MLFQConfig(starvation_s=1.0)), clock)
    engine = FakeEngine(clock, step_time=0.011, swap_delay=swap_delay)
    added: list[Job] = []
    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, share, priority, family = op
            live = [j for j in added if j.job_id in core.jobs]
            job_id = f"j{len(added)}"
            if share is not None and live:
                leader = live[share % len(live)]
                job = Job(job_id, list(leader.prompt_token_ids), max_tokens, clock(),
                          priority=priority)
                engine.share_prompt(job_id, leader.job_id, leader.num_prompt_tokens)
                core.add(job, share_prompt_with=leader.job_id)
            else:
                prompt = [len(added) + 1] * prompt_len
                if family is not None:
                    head = min(FAMILY_PREFIX, prompt_len)
                    prompt[:head] = [500 + family] * head
                job = Job(job_id, prompt, max_tokens, clock(), priority=priority)
                core.add(job)
            added.append(job)
        elif op[0] == "abort" and added:
            core.abort(added[op[1] % len(added)].job_id)
        elif op[0] == "step":
            for _ in range(op[1]):
                run_step(core, engine)
        check_state(core)
    for _ in range(2000):
        if not core.has_work:
            break
        run_step(core, engine)
    assert not core.has_work, "scheduler did not drain"
    assert core.blocks.num_free == num_blocks and core.swap.host_used == 0
    for job in added:
        if job.state is JobState.FINISHED:
            assert job.output_token_ids == [1000 + k for k in range(job.max_tokens)]
        else:
            assert job.state is JobState.ABORTED
    return core
