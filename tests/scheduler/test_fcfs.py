"""FCFS policy: order, budgets, preemption of the newest, abort, accounting."""

from __future__ import annotations

import pytest

from scheduler.config import SchedulerConfig
from scheduler.job import JobState
from tests.scheduler.conftest import FakeEngine, drain, make_core, make_job


def run_to_end(core, engine, max_steps: int = 10_000):
    finished_order: list[str] = []
    plans = []
    for _ in range(max_steps):
        if not core.has_work:
            break
        plan = core.schedule()
        plans.append(plan)
        core.blocks.check()
        events = core.complete(plan, engine.execute(plan))
        core.blocks.check()
        finished_order += [e.job_id for e in events if e.finished]
    assert not core.has_work, "scheduler did not drain"
    return finished_order, plans


def test_fcfs_admits_in_arrival_order(clock):
    core = make_core(clock, max_batch_size=2)
    jobs = [make_job(4, 3, job_id=f"a{i}") for i in range(4)]
    for j in jobs:
        core.add(j)
    plan = core.schedule()
    assert [c.job_id for c in plan.chunks] == ["a0", "a1"]
    finished, _ = run_to_end(core, FakeEngine(clock))
    assert finished == ["a0", "a1", "a2", "a3"]


def test_batch_size_and_token_budget_respected(clock):
    core = make_core(clock, max_batch_size=3, max_batch_tokens=10, num_blocks=64)
    for i in range(6):
        core.add(make_job(7, 4))
    _, plans = run_to_end(core, FakeEngine(clock))
    for p in plans:
        assert len(p.chunks) <= 3
        assert p.num_tokens <= 10


def test_chunked_prefill_splits_long_prompt(clock):
    core = make_core(clock, max_batch_tokens=8, max_model_len=64)
    job = make_job(20, 2)
    core.add(job)
    engine = FakeEngine(clock)
    p1 = core.schedule()
    assert [(c.start_pos, c.num_tokens, c.sample) for c in p1.chunks] == [(0, 8, False)]
    core.complete(p1, engine.execute(p1))
    p2 = core.schedule()
    assert [(c.start_pos, c.num_tokens) for c in p2.chunks] == [(8, 8)]
    core.complete(p2, engine.execute(p2))
    p3 = core.schedule()
    assert [(c.start_pos, c.num_tokens, c.sample) for c in p3.chunks] == [(16, 4, True)]
    assert p3.chunks[0].token_ids == list(range(17, 21))


def test_decodes_and_prefill_share_an_iteration(clock):
    core = make_core(clock, max_batch_tokens=16)
    a = make_job(4, 10, job_id="a")
    core.add(a)
    engine = FakeEngine(clock)
    p = core.schedule()
    core.complete(p, engine.execute(p))
    core.add(make_job(30, 2, job_id="b"))
    p = core.schedule()
    kinds = {c.job_id: c.num_tokens for c in p.chunks}
    assert kinds == {"a": 1, "b": 15}


def test_preempts_newest_when_blocks_run_out(clock):
    # 16 blocks of 4 tokens = 64 slots; three jobs each growing to 24 tokens.
    core = make_core(clock, num_blocks=16, block_size=4, max_model_len=64)
    jobs = [make_job(8, 16, job_id=f"p{i}") for i in range(3)]
    for j in jobs:
        core.add(j)
    engine = FakeEngine(clock)
    preempted: list[str] = []
    while core.has_work:
        plan = core.schedule()
        preempted += plan.preempted
        core.complete(plan, engine.execute(plan))
        core.blocks.check()
    assert preempted, "the budget was meant to force a preemption"
    assert preempted[0] == "p2"  # the newest running job goes first
    assert jobs[2].num_preemptions >= 1
    assert jobs[0].num_preemptions == 0  # the oldest always runs to completion
    # Recomputation reproduces the same outputs (fake engine is position-based).
    for j in jobs:
        assert j.output_token_ids == [1000 + k for k in range(16)]
        assert j.state is JobState.FINISHED
    assert core.blocks.num_free == 16


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempted_job_is_recomputed_with_its_outputs(clock, prefix_caching):
    core = make_core(clock, num_blocks=16, block_size=4, max_model_len=64,
                     prefix_caching=prefix_caching)
    core.add(make_job(8, 16, job_id="old"))
    core.add(make_job(8, 16, job_id="new"))
    core.add(make_job(8, 16, job_id="newest"))
    engine = FakeEngine(clock)
    while True:
        plan = core.schedule()
        if plan.preempted:
            break
        core.complete(plan, engine.execute(plan))
    victim = core.jobs[plan.preempted[0]]
    assert victim.state is JobState.PREEMPTED
    assert victim.block_table == [] and victim.num_computed_tokens == 0
    generated = list(victim.output_token_ids)
    core.complete(plan, engine.execute(plan))
    # When it comes back, its first chunk re-feeds prompt + generated tokens.
    while True:
        plan = core.schedule()
        chunk = next((c for c in plan.chunks if c.job_id == victim.job_id), None)
        if chunk is not None:
            break
        core.complete(plan, engine.execute(plan))
    if not prefix_caching:
        assert chunk.start_pos == 0
        assert chunk.token_ids[:8] == victim.prompt_token_ids
        assert chunk.token_ids[8:] == generated[: len(chunk.token_ids) - 8]
    else:
        # Its full blocks were parked when it was preempted (tail first, so
        # that the others' growth evicts its tail first): it adopts those
        # still there and computes only the rest.
        full = (8 + len(generated) - 1) // 4 * 4
        assert 8 <= chunk.start_pos <= full and chunk.start_pos % 4 == 0
        tokens = victim.prompt_token_ids + generated
        assert chunk.token_ids == tokens[chunk.start_pos:]
    drain(core, engine)
    assert victim.output_token_ids == [1000 + k for k in range(16)]


def test_abort_frees_blocks_everywhere(clock):
    core = make_core(clock)
    running, waiting = make_job(10, 5), make_job(10, 5)
    core.add(running)
    p = core.schedule()
    core.complete(p, FakeEngine(clock).execute(p))
    core.add(waiting)
    assert core.blocks.num_used > 0
    assert core.abort(running.job_id)
    assert core.abort(waiting.job_id)
    assert not core.abort("nope")
    assert core.blocks.num_free == core.blocks.num_blocks
    assert running.state is JobState.ABORTED and waiting.state is JobState.ABORTED
    core.blocks.check()
    assert core.schedule().chunks == []


def test_abort_during_iteration_is_ignored_by_complete(clock):
    core = make_core(clock)
    job = make_job(5, 5)
    core.add(job)
    plan = core.schedule()
    result = FakeEngine(clock).execute(plan)
    core.abort(job.job_id)
    assert core.complete(plan, result) == []
    assert core.blocks.num_free == core.blocks.num_blocks


def test_finishes_on_engine_stop_and_on_length(clock):
    core = make_core(clock, max_model_len=12)
    a, b = make_job(4, 100, job_id="a"), make_job(4, 3, job_id="b")
    core.add(a)
    core.add(b)
    _, _ = run_to_end(core, FakeEngine(clock))
    assert b.finish_reason == "length" and b.num_output_tokens == 3
    # a hits max_model_len = 12 tokens in total.
    assert a.finish_reason == "length" and a.num_tokens == 12


def test_rejects_prompt_at_max_model_len(clock):
    core = make_core(clock, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        core.add(make_job(16, 1))


def test_config_rejects_cache_smaller_than_one_sequence():
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(num_blocks=2, block_size=4, max_model_len=64)


def test_many_random_jobs_never_leak(clock):
    import random

    rng = random.Random(0)
    core = make_core(clock, num_blocks=20, block_size=4, max_batch_size=6,
                     max_batch_tokens=24, max_model_len=64)
    engine = FakeEngine(clock)
    pending = [make_job(rng.randint(1, 30), rng.randint(1, 20)) for _ in range(60)]
    aborted = set()
    steps = 0
    while pending or core.has_work:
        steps += 1
        if pending and rng.random() < 0.5:
            core.add(pending.pop())
        if core.jobs and rng.random() < 0.03:
            jid = rng.choice(sorted(core.jobs))
            core.abort(jid)
            aborted.add(jid)
        plan = core.schedule()
        assert core.blocks.num_free >= 0
        core.complete(plan, engine.execute(plan))
        core.blocks.check()
        assert steps < 20_000
    assert core.blocks.num_free == 20
    assert core.num_finished + core.num_aborted == 60


@pytest.mark.parametrize("swap_delay", [0, 2])
def test_reactive_swap_preserves_kv_and_progress(clock, swap_delay):
    core = make_core(clock, num_blocks=16, block_size=4, max_model_len=64,
                     swap_mode="reactive", host_kv_blocks=64)
    jobs = [make_job(8, 16, job_id=f"s{i}") for i in range(3)]
    for j in jobs:
        core.add(j)
    engine = FakeEngine(clock, swap_delay=swap_delay)
    finished, _ = run_to_end(core, engine)
    assert engine.swapped_out_blocks > 0
    # Every block swapped out came back: copied, or still on the device
    # (parked by the prefix cache, `SwapManager.swap_in`).
    assert engine.swapped_in_blocks + core.swap.blocks_kept == engine.swapped_out_blocks
    # Swapped, not recomputed: no job re-fed its prompt after a preemption.
    assert core.swap.num_swap_out >= 1 and core.swap.num_recompute_fallbacks == 0
    for j in jobs:
        assert j.output_token_ids == [1000 + k for k in range(16)]
    assert core.swap.host_used == 0 and engine.host == {}
    assert core.blocks.num_free == 16


def test_full_host_tier_falls_back_to_recompute(clock):
    core = make_core(clock, num_blocks=16, block_size=4, max_model_len=64,
                     swap_mode="reactive", host_kv_blocks=1)
    for i in range(3):
        core.add(make_job(8, 16, job_id=f"h{i}"))
    run_to_end(core, FakeEngine(clock))
    assert core.swap.num_recompute_fallbacks >= 1
    assert core.swap.num_swap_out == 0


def test_abort_of_swapped_job_drops_its_host_copy(clock):
    core = make_core(clock, num_blocks=16, block_size=4, max_model_len=64,
                     swap_mode="reactive", host_kv_blocks=64)
    for i in range(3):
        core.add(make_job(8, 16, job_id=f"x{i}"))
    engine = FakeEngine(clock, swap_delay=50)
    while core.swap.host_used == 0:
        p = core.schedule()
        core.complete(p, engine.execute(p))
    swapped = next(j for j in core.jobs.values() if j.num_host_blocks)
    core.abort(swapped.job_id)
    assert core.swap.host_used == 0
    p = core.schedule()
    assert any(op.kind.value == "drop" and op.job_id == swapped.job_id for op in p.block_ops)
