"""Co-serving (ConServe §4.2, §4.5) on a fake clock: online work never waits
behind offline work, offline tokens stay within the SLO budget while online
work is present, offline batching mode when it is not, and preempted
offline jobs lose neither tokens nor KV integrity."""

from __future__ import annotations

import random

import pytest

from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.cost import LinearCost
from scheduler.job import Job, JobClass
from scheduler.plan import Plan
from scheduler.cost_fit import IterationShape
from tests.scheduler.conftest import FakeClock, FakeEngine, drain, make_job

# An iteration of n tokens costs 10 ms + 1 ms per token; a batch-1 decode 11 ms.
COST = LinearCost(base_s=0.010, prefill_per_token_s=0.001, decode_per_seq_s=0.001)


def core_for(clock: FakeClock, **kw) -> SchedulerCore:
    conserve = kw.pop("conserve", {})
    cfg = dict(policy="conserve", block_size=4, num_blocks=64, max_batch_size=8,
               max_batch_tokens=64, max_model_len=64, conserve=conserve)
    cfg.update(kw)
    return SchedulerCore(SchedulerConfig(**cfg), clock, cost=COST)


def offline(prompt_len: int, max_tokens: int, t: float = 0.0) -> Job:
    job = make_job(prompt_len, max_tokens, t)
    job.job_class = JobClass.OFFLINE
    return job


def add_offline(core: SchedulerCore, engine: FakeEngine, count: int, prompt_len: int,
                max_tokens: int, steps: int = 0) -> list[Job]:
    """`count` offline jobs, then `steps` iterations."""
    jobs = [offline(prompt_len, max_tokens) for _ in range(count)]
    for j in jobs:
        core.add(j)
    for _ in range(steps):
        step(core, engine)
    return jobs


def classes(core: SchedulerCore, plan: Plan) -> dict[JobClass, int]:
    """Tokens of each class in `plan` (before it completes)."""
    out = {JobClass.ONLINE: 0, JobClass.OFFLINE: 0}
    for c in plan.chunks:
        out[core.jobs[c.job_id].job_class] += c.num_tokens
    return out


def step(core: SchedulerCore, engine: FakeEngine) -> tuple[Plan, dict[JobClass, int]]:
    plan = core.schedule()
    tokens = classes(core, plan)
    core.complete(plan, engine.execute(plan))
    core.blocks.check(core.jobs.values())
    return plan, tokens


def test_objectives_and_the_iteration_estimate(clock: FakeClock) -> None:
    policy = core_for(clock, conserve={"ttft_slo_s": 0.05, "tpot_slo_s": 0.03}).policy
    assert policy.slo() == (0.05, 0.03)
    # Derived objectives: 10x and 3x the batch-1 decode iteration (11 ms).
    assert core_for(clock).policy.slo() == pytest.approx((0.11, 0.033))
    # The fixed 10 ms counts once in a mixed batch of 4 decodes and a
    # 20-token prefill.
    shape = IterationShape()
    for i in range(4):
        shape = shape.plus(10 + i, 1)
    assert policy.estimate(shape) == pytest.approx(0.014)
    assert policy.estimate(shape.plus(0, 20)) == pytest.approx(0.034)
    # The largest prefill chunk within 30 ms beside the 4 decodes: 16 tokens.
    prompt = make_job(64, 4)
    assert policy._fit(shape, prompt, 64, 0.030) == 16
    decoding = make_job(4, 4)
    decoding.num_computed_tokens = 4
    decoding.output_token_ids = [7]
    for i in range(15):
        shape = shape.plus(10, 1)
    assert policy._fit(shape, decoding, 1, 0.030) == 1  # 20 decodes: 30 ms
    assert policy._fit(shape.plus(10, 1), decoding, 1, 0.030) == 0


def test_offline_batching_mode_ignores_the_budget(clock: FakeClock) -> None:
    core = core_for(clock, max_batch_tokens=16, num_blocks=128, max_model_len=128,
                    conserve={"tpot_slo_s": 0.015, "offline_max_batch_tokens": 96,
                              "offline_max_batch_size": 12})
    engine = FakeEngine(clock)
    jobs = [offline(8, 4) for _ in range(12)]
    for job in jobs:
        core.add(job)
    plan, _ = step(core, engine)
    assert not core.policy.coserving
    assert plan.num_tokens == 96 and len(plan.chunks) == 12  # 12 prompts of 8
    drain(core, engine)
    assert all(j.output_token_ids == [1000, 1001, 1002, 1003] for j in jobs)


def test_online_work_never_waits_behind_offline_work(clock: FakeClock) -> None:
    core = core_for(clock, max_batch_size=32,
                    conserve={"ttft_slo_s": 0.05, "tpot_slo_s": 0.025,
                              "offline_max_batch_size": 16})
    engine = FakeEngine(clock)
    offs = [offline(2, 10) for _ in range(16)]
    for j in offs:
        core.add(j)
    step(core, engine)
    step(core, engine)  # 16 offline jobs decoding, in offline batching mode
    on = make_job(30, 5, clock.t)
    core.add(on)
    plan, tokens = step(core, engine)
    # The online prompt is planned first and in full (40 ms); offline
    # decodes join while the iteration stays within the TTFT objective
    # (50 ms: 10 ms + 30 prefill tokens + 10 decodes): 10 of the 16.
    assert plan.chunks[0].job_id == on.job_id and plan.chunks[0].num_tokens == 30
    assert tokens[JobClass.OFFLINE] == 10
    assert core.policy.coserving and core.policy.offline_paused == 6
    # Now the online job decodes: within the TPOT objective (25 ms: 10 ms
    # + 15 decodes), 14 offline decodes join it.
    plan, tokens = step(core, engine)
    assert tokens == {JobClass.ONLINE: 1, JobClass.OFFLINE: 14}
    assert core.policy.offline_paused == 2
    drain(core, engine)
    for job in offs + [on]:
        assert job.output_token_ids == [1000 + i for i in range(job.max_tokens)]


def test_online_takes_the_memory_of_offline_jobs(clock: FakeClock) -> None:
    """KV full of offline work: the online job's blocks come from offline
    jobs at once, and everyone's tokens come out intact."""
    for mode, host in (("recompute", 0), ("reactive", 64)):
        core = core_for(clock, num_blocks=16, max_model_len=32, swap_mode=mode,
                        host_kv_blocks=host, conserve={"tpot_slo_s": 0.05})
        engine = FakeEngine(clock)
        offs = add_offline(core, engine, 4, 12, 12, steps=3)
        assert core.blocks.num_free < 4
        on = make_job(16, 4, clock.t)
        core.add(on)
        plan, _ = step(core, engine)
        assert plan.chunks[0].job_id == on.job_id, mode
        assert plan.preempted and all(core.jobs[j].job_class is JobClass.OFFLINE
                                      for j in plan.preempted)
        drain(core, engine)
        for job in offs + [on]:
            assert job.output_token_ids == [1000 + i for i in range(job.max_tokens)], mode


@pytest.mark.parametrize("order", ["fcfs", "mlfq"])
@pytest.mark.parametrize("mode", ["recompute", "reactive"])
@pytest.mark.parametrize("seed", range(6))
def test_random_mix_drains_with_online_first(seed: int, mode: str, order: str) -> None:
    rng = random.Random(seed)
    clock = FakeClock()
    core = core_for(clock, num_blocks=24, max_model_len=48, max_batch_size=6,
                    max_batch_tokens=32, swap_mode=mode,
                    host_kv_blocks=0 if mode == "recompute" else 48,
                    conserve={"tpot_slo_s": 0.025, "offline_max_batch_size": 8,
                              "online_order": order})
    engine = FakeEngine(clock, swap_delay=rng.randint(0, 2))
    jobs: list[Job] = []
    for i in range(40):
        if i % 2:
            job = offline(rng.randint(1, 20), rng.randint(1, 20))
        else:
            job = make_job(rng.randint(1, 20), rng.randint(1, 20))
        jobs.append(job)
    pending = list(jobs)
    online_ids = {j.job_id for j in jobs if j.job_class is JobClass.ONLINE}
    steps = 0
    while pending or core.has_work:
        if pending and rng.random() < 0.4:
            core.add(pending.pop(0))
        if not core.has_work:
            continue
        plan, tokens = step(core, engine)
        steps += 1
        assert steps < 5000
        policy = core.policy
        if tokens[JobClass.OFFLINE] and policy.coserving:
            # Offline tokens only where online work could not use them.
            online_blocked = (
                tokens[JobClass.ONLINE] >= core.config.max_batch_tokens
                or len(policy.running(JobClass.ONLINE)) >= core.config.max_batch_size
                or not policy.waiting(JobClass.ONLINE)
            )
            assert online_blocked, plan
            # The whole iteration within the TTFT objective (the larger).
            ttft, _ = policy.slo()
            online, whole = IterationShape(), IterationShape()
            for c in plan.chunks:
                whole = whole.plus(c.start_pos, c.num_tokens)
                if c.job_id in online_ids:
                    online = online.plus(c.start_pos, c.num_tokens)
            if policy.estimate(online) <= ttft:
                assert policy.estimate(whole) <= ttft + 1e-9
    for job in jobs:
        assert job.output_token_ids == [1000 + i for i in range(job.max_tokens)]
    assert core.blocks.num_free == core.config.num_blocks


def _short_after_long(clock: FakeClock, order: str) -> tuple[Job, list[int], SchedulerCore]:
    """A long online job holds the iteration's tokens; three short online
    jobs arrive behind it, with offline work in the background."""
    core = core_for(clock, num_blocks=64, max_model_len=128, max_batch_tokens=24,
                    conserve={"tpot_slo_s": 0.05, "ttft_slo_s": 0.05, "online_order": order})
    engine = FakeEngine(clock)
    add_offline(core, engine, 2, 8, 20)
    long = make_job(96, 12, clock.t)
    core.add(long)
    step(core, engine)
    shorts = [make_job(4, 3, clock.t) for _ in range(3)]
    for j in shorts:
        core.add(j)
    first: dict[str, int] = {}
    n = 0
    while core.has_work:
        n += 1
        step(core, engine)
        for j in [long, *shorts]:
            if j.output_token_ids and j.job_id not in first:
                first[j.job_id] = n
    for j in core.jobs.values():
        raise AssertionError(f"{j.job_id} left over")
    for j in [long, *shorts]:
        assert j.output_token_ids == [1000 + i for i in range(j.max_tokens)]
    return long, [first[j.job_id] for j in shorts], core


def test_mlfq_order_lets_short_online_jobs_overtake_a_long_one(clock: FakeClock) -> None:
    """`online_order: mlfq` (FastServe §4.1 within the online class): the
    short jobs skip-join a higher queue than the long prompt and get their
    first tokens while it is still prefilling; `fcfs` runs them after it."""
    long, mlfq_first, core = _short_after_long(clock, "mlfq")
    levels = core.policy.mlfq
    assert levels is not None and levels.num_demotions > 0
    _, fcfs_first, _ = _short_after_long(FakeClock(), "fcfs")
    # The long prompt takes 4 iterations of 24 tokens; the short jobs'
    # first tokens come in the first iteration after they arrive with
    # `mlfq`, after the long prefill with `fcfs`.
    assert max(mlfq_first) == 1
    assert min(fcfs_first) >= 3


def test_a_pass_is_cut_only_when_waiting_for_it_would_miss_the_ttft(clock: FakeClock) -> None:
    """Algorithm 2: an online arrival cuts an offline batching pass unless
    the rest of the pass plus its own prefill fits the TTFT objective."""
    core = core_for(clock, max_batch_tokens=64,
                    conserve={"ttft_slo_s": 0.09, "offline_max_batch_tokens": 64})
    add_offline(core, FakeEngine(clock), 1, 60, 4)
    plan = core.schedule()
    assert plan.preemptible_at_layers and plan.num_tokens == 60
    policy = core.policy
    # The pass: 10 ms + 60 x 1 ms = 70 ms; a 20-token online prompt: 30 ms.
    assert policy.cut_wanted(plan, 0.0, 20)  # 70 + 30 > 90
    assert not policy.cut_wanted(plan, 0.02, 20)  # 50 + 30 <= 90
    assert policy.cut_wanted(plan, 0.02, 40)  # 50 + 50 > 90: the prompts add up
    assert not policy.cut_wanted(plan, 1.0, 80)  # pass over; 64 tokens fit: 74 ms


@pytest.mark.parametrize("pred", [40, 20])
def test_predicted_admission_keeps_offline_jobs_from_evicting_each_other(pred: int) -> None:
    """Eight offline jobs of 8 prompt + 40 output tokens need 96 blocks at
    their end; 64 exist.  Admitted on free blocks they outgrow the cache and
    evict one another; admitted by predicted length none is evicted when
    the prediction is right, and an under-prediction costs evictions but
    never work (every job finishes with all its tokens)."""
    def run(admission: str) -> tuple[int, list[Job]]:
        clock = FakeClock()
        core = core_for(clock, conserve={"offline_admission": admission})
        engine = FakeEngine(clock)
        jobs = [offline(8, 40) for _ in range(8)]
        for j in jobs:
            j.predicted_output_len = pred
            core.add(j)
        drain(core, engine)
        assert all(len(j.output_token_ids) == 40 for j in jobs)
        return sum(j.num_preemptions for j in jobs), jobs

    free, _ = run("free")
    predicted, _ = run("predicted")
    assert free > 0
    # Right: no eviction.  Half the length: the gate admits too many,
    # as free blocks would.
    assert (predicted == 0) == (pred == 40)
