"""`priority` with vLLM's meaning (lower runs first) in FCFS and MLFQ."""

from __future__ import annotations

import random

import pytest

from scheduler.config import MLFQConfig, SchedulerConfig
from scheduler.cost import LinearCost
from scheduler.core import SchedulerCore
from tests.scheduler.conftest import FakeClock, FakeEngine, drain, make_core, make_job, step

COST = LinearCost(base_s=0.010, prefill_per_token_s=0.001, decode_per_seq_s=0.001)


def finish_order(core, engine) -> list[str]:
    done: list[str] = []
    while core.has_work:
        before = set(core.jobs)
        step(core, engine)
        done += sorted(before - set(core.jobs))
    return done


# FCFS -------------------------------------------------------------------


def test_fcfs_admits_a_more_important_later_arrival_first(clock):
    core = make_core(clock, max_batch_size=1)
    core.add(make_job(4, 3, job_id="a"))
    core.add(make_job(4, 3, job_id="b"))
    core.add(make_job(4, 3, job_id="c", priority=-1))
    assert finish_order(core, FakeEngine(clock)) == ["c", "a", "b"]


def test_fcfs_runs_to_completion_whatever_arrives(clock):
    # vLLM v1 does not preempt a running job for a waiting one.
    core = make_core(clock, max_batch_size=1)
    core.add(make_job(4, 6, job_id="a", priority=3))
    engine = FakeEngine(clock)
    step(core, engine)
    core.add(make_job(4, 3, job_id="b"))
    core.add(make_job(4, 3, job_id="c", priority=-5))
    assert finish_order(core, engine) == ["a", "c", "b"]


@pytest.mark.parametrize("b_first", [False, True])
def test_fcfs_preempts_the_largest_priority_value_first(clock, b_first):
    # 16 blocks; three jobs growing to 6 blocks each.  Without priorities
    # the newest ("c") would go, or with "b" admitted first, "c" too; here
    # the least important one does.
    core = make_core(clock, num_blocks=16)
    jobs = [make_job(8, 16, job_id=i, priority=p) for i, p in (("a", 0), ("b", 5), ("c", 1))]
    engine = FakeEngine(clock)
    if b_first:
        core.add(jobs[1])
        step(core, engine)
    for j in jobs:
        if j.job_id not in core.jobs:
            core.add(j)
    first = step(core, engine)
    assert [c.job_id for c in first.chunks] == (["b", "a", "c"] if b_first else ["a", "c", "b"])
    assert [j.job_id for j in core.policy.running] == ["a", "c", "b"]
    preempted: list[str] = []
    while core.has_work:
        preempted += step(core, engine).preempted
    assert preempted[0] == "b"
    assert jobs[0].num_preemptions == 0 and jobs[2].num_preemptions == 0
    for j in jobs:
        assert j.output_token_ids == [1000 + k for k in range(16)]


def test_fcfs_preempted_job_waits_behind_more_important_ones_only(clock):
    core = make_core(clock, num_blocks=16)
    for i, p in (("a", 0), ("b", 5), ("c", 1)):
        core.add(make_job(8, 16, job_id=i, priority=p))
    engine = FakeEngine(clock)
    while not (plan := step(core, engine)).preempted:
        pass
    assert plan.preempted == ["b"]
    core.add(make_job(4, 2, job_id="d", priority=5))
    core.add(make_job(4, 2, job_id="e", priority=-1))
    assert [j.job_id for j in core.policy.waiting] == ["e", "b", "d"]


# MLFQ -------------------------------------------------------------------


def mlfq(clock, **kw) -> SchedulerCore:
    cfg = dict(policy="mlfq", block_size=4, num_blocks=64, max_batch_size=8,
               max_batch_tokens=256, max_model_len=256)
    cfg.update(kw)
    return SchedulerCore(SchedulerConfig(**cfg), clock, cost=COST)


def test_mlfq_serves_a_more_important_class_first_and_to_the_end(clock):
    # "long" skip-joins a low queue (200-token prompt) but outranks "short".
    core = mlfq(clock, max_batch_size=1)
    engine = FakeEngine(clock, step_time=0.011)
    core.add(make_job(4, 20, job_id="short"))
    step(core, engine)
    core.add(make_job(200, 10, job_id="long", priority=-1))
    assert core.policy.level["long"] > core.policy.level["short"]
    ran: list[str] = []
    while "long" in core.jobs:
        ran += [c.job_id for c in step(core, engine).chunks]
    assert ran == ["long"] * 10


def test_mlfq_enst_counts_only_jobs_that_run_ahead(clock):
    core = mlfq(clock)
    pol = core.policy
    core.add(make_job(200, 4, job_id="a"))  # Q6
    e = pol.enst(clock())
    core.add(make_job(5, 4, job_id="b", priority=1))  # Q2, less important
    e2 = pol.enst(clock())
    assert e2["a"] == e["a"] == 0.0  # b never runs ahead of a
    assert e2["b"] > 0.0  # a does run ahead of b, however low its queue
    core.add(make_job(5, 4, job_id="c"))  # Q2, same class as a
    assert pol.enst(clock())["a"] > 0.0


def test_mlfq_evicts_the_least_important_class_first(clock):
    # y (priority 2) idles close to its starvation promotion, so its ENST
    # is smaller than x's: ENST alone would evict x.
    n = 10
    core = make_core(clock, policy="mlfq", num_blocks=16, max_batch_size=1,
                     mlfq=MLFQConfig(starvation_s=n * 0.011 + 0.001))
    engine = FakeEngine(clock, step_time=0.011)
    y = make_job(20, 40, job_id="y", priority=2)
    core.add(y)
    for _ in range(4):
        step(core, engine)
    x = make_job(20, 40, job_id="x")
    core.add(x)
    for _ in range(n - 1):
        assert [c.job_id for c in step(core, engine).chunks] == ["x"]
    core.add(make_job(16, 2, job_id="z", priority=-1))  # needs one block more than free
    enst = core.policy.enst(clock())
    assert enst["y"] < enst["x"]
    plan = step(core, engine)
    assert [c.job_id for c in plan.chunks] == ["z"] and plan.preempted == ["y"]
    drain(core, engine)
    for j in (x, y):
        assert j.output_token_ids == [1000 + k for k in range(40)]


# Equal priorities -------------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "mlfq", "fixed-priority"])
@pytest.mark.parametrize("mode", ["recompute", "reactive", "proactive"])
def test_equal_priorities_schedule_as_without_priorities(policy, mode):
    def trace(priority: int) -> list[tuple]:
        rng = random.Random(7)
        clock = FakeClock()
        core = mlfq(clock, policy=policy, num_blocks=40, max_batch_size=4, max_model_len=128,
                    swap_mode=mode, host_kv_blocks=0 if mode == "recompute" else 64)
        engine = FakeEngine(clock, step_time=0.011, swap_delay=1)
        out: list[tuple] = []
        for i in range(2000):
            if i < 200 and rng.random() < 0.2:
                core.add(make_job(rng.randint(4, 40), rng.randint(4, 60),
                                  job_id=f"j{i}", priority=priority))
            if i >= 200 and not core.has_work:
                break
            plan = step(core, engine)
            out.append((tuple((c.job_id, c.start_pos, c.num_tokens) for c in plan.chunks),
                        tuple((o.kind, o.job_id, tuple(o.device_blocks)) for o in plan.block_ops),
                        tuple(plan.preempted)))
        assert not core.has_work
        return out

    base = trace(0)
    assert any(p[2] for p in base), "the workload was meant to preempt"
    assert trace(3) == base
