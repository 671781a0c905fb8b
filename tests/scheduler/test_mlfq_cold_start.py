"""A job with no KV does not start by throwing away a started job's KV
(`mlfq.cold_start_recompute`, default off): it starts in free blocks or by
evicting jobs whose KV goes to the host, and otherwise waits.  FastServe
§4.2's strawman 2 (kill and recompute) is what the switch turns back on."""

from __future__ import annotations

import pytest

from scheduler.config import MLFQConfig
from scheduler.plan import BlockOpKind
from tests.scheduler.conftest import FakeEngine, drain, make_core, make_job, step


def _two_started_then_a_newcomer(clock, **kw):
    core = make_core(clock, policy="mlfq", num_blocks=16, max_batch_size=4, **kw)
    engine = FakeEngine(clock)
    # 7 blocks each when done: both fit, and the newcomer's 6 do not.
    a, b = make_job(20, 8, job_id="a"), make_job(20, 8, job_id="b")
    core.add(a)
    core.add(b)
    for _ in range(4):  # both prefilled, decoding, demoted below Q1
        step(core, engine)
    assert a.num_output_tokens and b.num_output_tokens and core.blocks.num_free < 6
    c = make_job(24, 4, job_id="c")
    core.add(c)
    return core, engine, (a, b, c)


def _outputs_ok(*jobs):
    for j in jobs:
        assert j.output_token_ids == [1000 + k for k in range(j.max_tokens)]


def test_a_newcomer_waits_instead_of_dropping_a_started_jobs_kv(clock):
    core, engine, (a, b, c) = _two_started_then_a_newcomer(clock, swap_mode="recompute")
    plan = step(core, engine)
    assert plan.preempted == [] and "c" not in [ch.job_id for ch in plan.chunks]
    plans = drain(core, engine)
    assert not any(p.preempted for p in plans)
    assert core.swap.tokens_dropped == 0
    _outputs_ok(a, b, c)


def test_the_switch_brings_back_eviction_by_recomputation(clock):
    core, engine, (a, b, c) = _two_started_then_a_newcomer(
        clock, swap_mode="recompute", mlfq=MLFQConfig(cold_start_recompute=True))
    plan = step(core, engine)
    assert [ch.job_id for ch in plan.chunks][0] == "c" and plan.preempted
    drain(core, engine)
    assert core.swap.tokens_dropped > 0
    _outputs_ok(a, b, c)


@pytest.mark.parametrize("host_blocks, swaps", [(64, True), (0, False)])
def test_a_newcomer_evicts_by_swapping_only_where_the_host_has_room(clock, host_blocks, swaps):
    core, engine, (a, b, c) = _two_started_then_a_newcomer(
        clock, swap_mode="reactive", host_kv_blocks=host_blocks)
    plan = step(core, engine)
    outs = [op for op in plan.block_ops if op.kind is BlockOpKind.SWAP_OUT]
    assert bool(plan.preempted) is swaps and bool(outs) is swaps
    assert ("c" in [ch.job_id for ch in plan.chunks]) is swaps
    drain(core, engine)
    assert core.swap.tokens_dropped == 0
    _outputs_ok(a, b, c)


@pytest.mark.parametrize("mode", ["recompute", "proactive"])
def test_a_burst_larger_than_the_kv_tier_throws_less_work_away(clock, mode):
    """Forty jobs at once, each needing 15 of 48 device blocks (16 more on
    the host in proactive mode).  Started jobs still evict each other (a
    job that holds KV may drop a less urgent one's), but newcomers no
    longer do: far fewer computed tokens are thrown away, and jobs finish
    sooner on average."""
    results = {}
    for recompute in (False, True):
        clock.t = 0.0
        core = make_core(clock, policy="mlfq", num_blocks=48, max_batch_size=8,
                         max_model_len=128, swap_mode=mode, host_kv_blocks=16,
                         mlfq=MLFQConfig(cold_start_recompute=recompute))
        engine = FakeEngine(clock)
        jobs = [make_job(30, 30, job_id=f"{recompute}-{i}") for i in range(40)]
        for j in jobs:
            core.add(j)
        drain(core, engine)
        _outputs_ok(*jobs)
        assert core.blocks.num_free == 48 and core.swap.host_used == 0
        mean_jct = sum(j.finish_time for j in jobs) / len(jobs)
        results[recompute] = (core.swap.tokens_dropped, mean_jct)
    (dropped, jct), (dropped_old, jct_old) = results[False], results[True]
    assert dropped < dropped_old / 2 and jct < jct_old
