"""EconoServe (§3) on a fake clock: PT and GT queues, exact allocation with
the reserve, time-synced groups replenished when a group completes, KV
pipelining whose lenders never lose their space, ordering with the
bisection pick, and the under-prediction path (extension from the reserve,
offload-free preemption)."""

from __future__ import annotations

import random

import pytest

from scheduler.core import SchedulerCore
from scheduler.cost import LinearCost
from scheduler.job import Job
from scheduler.plan import BlockOpKind, Plan
from scheduler.policies.econoserve import FALLBACK_OUTPUT_LEN, EconoservePolicy
from scheduler.policies.kv_profile import Lease, Profile, peak_blocks
from tests.scheduler.conftest import FakeClock, FakeEngine, drain, make_core, make_job, step


def econo_core(clock: FakeClock, cost: LinearCost | None = None, **kw) -> SchedulerCore:
    econ = kw.pop("econoserve", {})
    econ.setdefault("pt_reserve", 0.0)
    core = make_core(clock, policy="econoserve", econoserve=econ, **kw)
    if cost is not None:
        core.policy.cost = cost
    return core


def job(prompt: int, max_tokens: int, alloc: int | None = None, **kw) -> Job:
    j = make_job(prompt, max_tokens, **kw)
    j.allocated_output_len = alloc
    return j


def add_mispredicted(core: SchedulerCore, rng: random.Random, count: int, err: int
                     ) -> list[Job]:
    """`count` jobs whose allocations miss their lengths by up to `err` tokens."""
    jobs = []
    for _ in range(count):
        j = job(rng.randint(1, 20), rng.randint(1, 30))
        j.allocated_output_len = max(1, j.max_tokens + rng.randint(-err, err))
        core.add(j)
        jobs.append(j)
    return jobs


def policy_of(core: SchedulerCore) -> EconoservePolicy:
    assert isinstance(core.policy, EconoservePolicy)
    return core.policy


def decoded(plan: Plan) -> set[str]:
    return {c.job_id for c in plan.chunks if c.num_tokens == 1 and c.start_pos > 0
            and c.output_index > 0}


# The KV profile -----------------------------------------------------------


def test_profile_matches_a_step_by_step_count() -> None:
    rng = random.Random(0)
    for _ in range(200):
        leases = [Lease(rng.randint(1, 40), rng.randint(0, 40), rng.randint(0, 6))
                  for _ in range(rng.randint(1, 8))]
        brute = max(sum(-(-(x.tokens + min(t, x.remaining)) // 4)
                        for x in leases if x.end >= t)
                    for t in range(0, max(x.end for x in leases) + 1))
        assert peak_blocks(leases, 4, pipelined=True) == brute
        prof = Profile(leases[:-1], 4, pipelined=True)
        assert prof.peak_with(leases[-1]) == brute
        assert peak_blocks(leases, 4, pipelined=False) == sum(
            -(-(x.tokens + x.remaining) // 4) for x in leases)


@pytest.mark.parametrize("bs", [1, 3, 16])
def test_profile_built_at_once_equals_one_built_lease_by_lease(bs: int) -> None:
    rng = random.Random(bs)
    for _ in range(100):
        leases = [Lease(rng.randint(1, 300), rng.randint(0, 300), rng.randint(0, 40))
                  for _ in range(rng.randint(1, 40))]
        whole = Profile(leases, bs, pipelined=True)
        grown = Profile([], bs, pipelined=True)
        for x in leases:
            grown.add(x)
        assert whole._at == grown._at and whole.peak == grown.peak


# Decoupling and time-synced groups (§3.3) ------------------------------------


def test_prompts_become_gts_that_join_the_batch_as_one_group(clock: FakeClock) -> None:
    core = econo_core(clock)
    engine = FakeEngine(clock)
    jobs = [job(8, 8, alloc=8) for _ in range(3)]
    for j in jobs:
        core.add(j)
    first = step(core, engine)
    assert {c.job_id for c in first.chunks} == {j.job_id for j in jobs}  # PTs
    policy = policy_of(core)
    assert len(policy.gts) == 3 and not policy.batch
    second = step(core, engine)
    assert decoded(second) == {j.job_id for j in jobs}
    assert policy.num_groups_admitted == 1 and policy.num_gts_admitted == 3


def test_a_waiting_group_is_admitted_when_a_group_completes(clock: FakeClock) -> None:
    # 10 blocks: each GT's allocation ends at 12 tokens (3 blocks), and the
    # prompts of the GTs not admitted still hold a block each.
    core = econo_core(clock, num_blocks=10, max_model_len=32)
    engine = FakeEngine(clock)
    jobs = [job(4, 8, alloc=8) for _ in range(4)]
    for j in jobs:
        core.add(j)
    plans = drain(core, engine)
    started = {j.job_id: next(i for i, p in enumerate(plans) if j.job_id in decoded(p))
               for j in jobs}
    last = jobs[-1].job_id
    first_three = [started[j.job_id] for j in jobs[:3]]
    assert len(set(first_three)) == 1  # one group, admitted together
    group_done = max(i for i, p in enumerate(plans)
                     if any(c.job_id == jobs[0].job_id for c in p.chunks))
    assert started[last] == group_done + 1  # replenished right after
    # Admission ran at the start and when the group completed, not between.
    assert policy_of(core).num_admissions == 2


def test_exact_allocation_holds_at_every_step(clock: FakeClock) -> None:
    rng = random.Random(1)
    core = econo_core(clock, num_blocks=40, max_batch_size=6, max_batch_tokens=24,
                      econoserve={"pipelining": False, "pt_reserve": 0.1})
    engine = FakeEngine(clock)
    policy = policy_of(core)
    jobs = add_mispredicted(core, rng, 40, 12)
    original = {j.job_id: j.allocated_output_len for j in jobs}
    steps = 0
    while core.has_work:
        plan = core.schedule()
        outside = core.blocks.num_used - sum(len(j.block_table) for j in policy.batch.values())
        peak = Profile([policy.lease(j) for j in policy.batch.values()], 4, False).peak
        assert peak + outside <= core.blocks.num_blocks
        for c in plan.chunks:
            j = core.jobs[c.job_id]
            # A GT decodes only within its allocation (extended ones included).
            assert j.num_output_tokens < policy.allocation(j) or not policy.is_gt(j)
        core.complete(plan, engine.execute(plan))
        core.blocks.check(core.jobs.values())
        steps += 1
        assert steps < 5000
    assert all(j.num_output_tokens == j.max_tokens for j in jobs)
    overran = sum(j.max_tokens > min(original[j.job_id], j.max_tokens) for j in jobs)
    assert overran and policy.num_overruns >= overran
    assert policy.num_extended + policy.num_paused == policy.num_overruns


# KV pipelining (§3.2) ------------------------------------------------------------


def _lender_and_hosted(clock: FakeClock, pipelining: bool, hosted_true: int,
                       keep_kv: bool = False) -> tuple[SchedulerCore, list[Plan], Job, Job]:
    # The lender's allocation ends at 44 tokens (11 blocks), the hosted
    # one's at 12 (3 blocks): 14 blocks exactly, in a cache of 13.
    core = econo_core(clock, num_blocks=13, max_model_len=48,
                      econoserve={"pipelining": pipelining, "pause_kv": "keep" if keep_kv else "drop"})
    engine = FakeEngine(clock)
    lender = job(4, 40, alloc=40)
    hosted = job(4, hosted_true, alloc=8)
    core.add(lender)
    core.add(hosted)
    return core, drain(core, engine), lender, hosted


def test_pipelining_hosts_a_short_gt_in_a_long_ones_tail(clock: FakeClock) -> None:
    _, plans, lender, hosted = _lender_and_hosted(clock, pipelining=True, hosted_true=8)
    both = [p for p in plans if {lender.job_id, hosted.job_id} <= decoded(p)]
    assert len(both) == 7  # decoding side by side from the start
    assert not any(p.preempted for p in plans)


def test_exact_allocation_keeps_the_short_gt_waiting(clock: FakeClock) -> None:
    _, plans, lender, hosted = _lender_and_hosted(clock, pipelining=False, hosted_true=8)
    assert not any({lender.job_id, hosted.job_id} <= decoded(p) for p in plans)


@pytest.mark.parametrize("keep_kv", [False, True], ids=["drop", "keep"])
def test_a_lender_never_finds_its_space_taken(clock: FakeClock, keep_kv: bool) -> None:
    # The hosted GT runs to 30 tokens against an allocation of 8: it is
    # extended, then paused (its KV dropped, or kept and evicted when the
    # lender needs the blocks).
    core, plans, lender, hosted = _lender_and_hosted(clock, pipelining=True, hosted_true=30,
                                                     keep_kv=keep_kv)
    assert not any(lender.job_id in p.preempted for p in plans)
    lender_steps = [i for i, p in enumerate(plans) if lender.job_id in decoded(p)]
    assert lender_steps == list(range(lender_steps[0], lender_steps[0] + 39))  # no gap
    assert hosted.num_output_tokens == 30
    policy = policy_of(core)
    assert policy.num_paused >= 1 and (policy.num_evicted >= 1 or not keep_kv)


def test_pipelined_lenders_are_never_preempted_under_random_load(clock: FakeClock) -> None:
    rng = random.Random(2)
    gave_way = 0
    for _ in range(10):
        core = econo_core(clock, num_blocks=48, max_batch_size=6, max_batch_tokens=24)
        engine = FakeEngine(clock)
        policy = policy_of(core)
        jobs = add_mispredicted(core, rng, 25, 10)
        original = {j.job_id: min(j.allocated_output_len, j.max_tokens) for j in jobs}
        while core.has_work:
            running = {jid for jid, j in policy.batch.items()
                       if j.num_output_tokens < original[jid]}
            plan = step(core, engine)
            # A GT running within its allocation when the plan began never
            # gives way: only jobs outside the batch or past their allocation.
            for jid in plan.preempted:
                assert jid not in running or core.jobs[jid].num_output_tokens >= original[jid]
            gave_way += len(plan.preempted)
        assert all(j.num_output_tokens == j.max_tokens for j in jobs)
    assert gave_way > 0


@pytest.mark.parametrize("swap_delay", [0, 2])
@pytest.mark.parametrize("mode", ["reactive", "proactive"])
@pytest.mark.parametrize("pause_kv", ["swap", "drop", "keep"])
def test_mispredicted_load_with_a_host_tier_finishes_with_its_kv_intact(
        clock: FakeClock, pause_kv: str, mode: str, swap_delay: int) -> None:
    # The fake engine checks every KV position a chunk reads: a GT swapped
    # out on a pause or an eviction and back again reads its own tokens.
    rng = random.Random(7)
    for host in (6, 64, 6, 64):  # a tier too small for some jobs, and a roomy one
        core = econo_core(clock, num_blocks=32, max_batch_size=6, max_batch_tokens=24,
                          swap_mode=mode, host_kv_blocks=host,
                          econoserve={"pause_kv": pause_kv})
        engine = FakeEngine(clock, swap_delay=swap_delay)
        jobs = add_mispredicted(core, rng, 20, 12)
        for _ in range(20_000):
            if not core.has_work:
                break
            step(core, engine)
        assert not core.has_work
        assert all(j.num_output_tokens == j.max_tokens for j in jobs)
        assert core.blocks.num_free == 32 and core.swap.host_used == 0
        assert policy_of(core).num_paused > 0
        if host == 64:  # room for every job: only `drop` recomputes anything
            assert (core.swap.tokens_dropped > 0) == (pause_kv == "drop")


# Ordering (§3.4) -------------------------------------------------------------------


def test_the_nearest_deadline_range_goes_first(clock: FakeClock) -> None:
    core = econo_core(clock, max_batch_tokens=8)
    engine = FakeEngine(clock)
    late = job(8, 4, alloc=4)
    late.deadline = 5.0
    none = job(8, 4, alloc=4)
    urgent = job(8, 4, alloc=4)
    urgent.deadline = 0.3
    for j in (late, none, urgent):
        core.add(j)
    order = []
    for _ in range(3):
        plan = step(core, engine)
        order += [c.job_id for c in plan.chunks if c.start_pos == 0]
    assert order == [urgent.job_id, late.job_id, none.job_id]


def test_a_pt_that_fits_the_budget_whole_is_picked_by_bisection(clock: FakeClock) -> None:
    core = econo_core(clock, max_batch_tokens=20)
    engine = FakeEngine(clock)
    p30, p18, p10 = job(30, 2, alloc=2), job(18, 2, alloc=2), job(10, 2, alloc=2)
    for j in (p10, p30, p18):
        core.add(j)
    plan = step(core, engine)
    sizes = {c.job_id: c.num_tokens for c in plan.chunks}
    assert sizes == {p18.job_id: 18, p30.job_id: 2}


def test_gts_holding_more_kv_go_first(clock: FakeClock) -> None:
    core = econo_core(clock, econoserve={"kv_range_tokens": 16})
    policy = policy_of(core)
    small, big = job(4, 4, alloc=4), job(40, 4, alloc=4)
    for j in (small, big):
        j.output_token_ids.append(7)
        j.num_computed_tokens = j.num_prompt_tokens
    assert policy.gt_key(big, 0.0) < policy.gt_key(small, 0.0)


# Under-prediction (§3.3.2) ------------------------------------------------------


def test_an_overrun_is_extended_in_place_when_the_reserve_has_room(clock: FakeClock) -> None:
    core = econo_core(clock, econoserve={"pt_reserve": 0.25})
    engine = FakeEngine(clock)
    j = job(4, 12, alloc=4)
    core.add(j)
    plans = drain(core, engine)
    policy = policy_of(core)
    assert j.num_output_tokens == 12
    assert policy.num_overruns >= 1 and policy.num_extended == policy.num_overruns
    assert not any(p.preempted for p in plans)


def test_an_overrun_without_room_pauses_keeping_its_kv(clock: FakeClock) -> None:
    core = econo_core(clock, num_blocks=12, max_model_len=48,
                      econoserve={"pipelining": False, "pause_kv": "keep"})
    engine = FakeEngine(clock)
    short = job(4, 20, alloc=4)  # under-predicted
    long = job(4, 28, alloc=28)
    core.add(short)
    core.add(long)
    paused_at = None
    computed_before = 0
    while core.has_work:
        before = short.num_computed_tokens
        plan = step(core, engine)
        if short.job_id in plan.preempted and paused_at is None:
            paused_at, computed_before = plan.step, before
            assert not any(op.job_id == short.job_id for op in plan.block_ops)
            assert short.num_computed_tokens == before and short.block_table
    policy = policy_of(core)
    assert paused_at is not None and policy.num_paused >= 1
    assert computed_before > 0 and core.swap.tokens_dropped == 0
    assert short.num_output_tokens == 20 and long.num_output_tokens == 28
    assert long.num_preemptions == 0


@pytest.mark.parametrize("pause_kv", ["drop", "swap"])
def test_an_overrun_without_room_drops_its_kv(clock: FakeClock, pause_kv: str) -> None:
    # "swap" without a host tier (swap_mode recompute, the default) drops too.
    core = econo_core(clock, num_blocks=12, max_model_len=48,
                      econoserve={"pipelining": False, "pause_kv": pause_kv})
    engine = FakeEngine(clock)
    short = job(4, 20, alloc=4)
    long = job(4, 28, alloc=28)
    core.add(short)
    core.add(long)
    paused = []
    while core.has_work:
        plan = core.schedule()
        if short.job_id in plan.preempted:
            paused.append(plan)
            # Offload-free: nothing copied to the host, the KV is dropped (a
            # chunk of it in the same plan starts over, on whole blocks of it
            # the prefix cache still holds at most).
            assert not any(op.kind is BlockOpKind.SWAP_OUT for op in plan.block_ops)
            bs = core.config.block_size
            assert all(c.start_pos % bs == 0 and c.start_pos < short.num_tokens
                       for c in plan.chunks if c.job_id == short.job_id)
        core.complete(plan, engine.execute(plan))
        core.blocks.check(core.jobs.values())
    assert paused and core.swap.tokens_dropped > 0
    assert short.num_output_tokens == 20 and long.num_output_tokens == 28
    assert long.num_preemptions == 0


def test_an_overrun_without_room_swaps_its_kv_to_the_host_tier(clock: FakeClock) -> None:
    core = econo_core(clock, num_blocks=12, max_model_len=48, swap_mode="proactive",
                      host_kv_blocks=64, econoserve={"pipelining": False, "pause_kv": "swap"})
    engine = FakeEngine(clock)
    short = job(4, 20, alloc=4)
    long = job(4, 28, alloc=28)
    core.add(short)
    core.add(long)
    paused, swapped_in = [], []
    while core.has_work:
        before = short.num_computed_tokens
        plan = core.schedule()
        ops = {op.kind for op in plan.block_ops if op.job_id == short.job_id}
        if short.job_id in plan.preempted:
            paused.append(plan)
            # Its computed KV is copied out, not dropped: it resumes where it left.
            assert BlockOpKind.SWAP_OUT in ops
            assert short.num_computed_tokens == before and short.num_host_blocks
        if BlockOpKind.SWAP_IN in ops:
            swapped_in.append(plan)
        core.complete(plan, engine.execute(plan))
        core.blocks.check(core.jobs.values())
    assert paused and swapped_in and policy_of(core).num_paused >= 1
    assert core.swap.tokens_dropped == 0
    assert short.num_output_tokens == 20 and long.num_output_tokens == 28
    assert long.num_preemptions == 0


def test_the_renamed_pause_setting_is_refused_by_name() -> None:
    from pydantic import ValidationError

    from scheduler.config import EconoserveConfig

    with pytest.raises(ValidationError, match="pause_keeps_kv is now pause_kv"):
        EconoserveConfig.model_validate({"pause_keeps_kv": True})
    assert EconoserveConfig().pause_kv == "swap"


# Jobs without a prediction, deadlines -------------------------------------------


def test_a_job_without_prediction_is_allocated_the_mean_finished_length(
        clock: FakeClock) -> None:
    core = econo_core(clock)
    engine = FakeEngine(clock)
    policy = policy_of(core)
    fresh = job(4, 50)
    assert policy.allocation(fresh) == min(50, 64 - 4, FALLBACK_OUTPUT_LEN)
    for n in (6, 10):
        core.add(job(4, n, alloc=n))
    drain(core, engine)
    assert policy.allocation(fresh) == 8
    fresh.predicted_output_len = 20
    assert policy.allocation(fresh) == 20  # a prediction that arrives later counts
    fresh.allocated_output_len = 23
    assert policy.allocation(fresh) == 23


def land(core: SchedulerCore, j: Job, predicted: int) -> None:
    """A prediction landing after `j` was added, as the engine loop applies one."""
    j.predicted_output_len = predicted
    j.allocated_output_len = predicted
    core.policy.on_prediction(j)


def test_late_predictions_never_overcommit_the_batch(clock: FakeClock) -> None:
    """Live, a prompt may be computed and its GT admitted before its
    prediction lands: the batch was admitted into the KV on the allocation
    assumed then, which the prediction must not enlarge (it did: the batch's
    peak went past the cache, and with it every new prompt's headroom)."""
    rng = random.Random(3)
    core = econo_core(clock, num_blocks=40, max_batch_size=6, max_batch_tokens=24,
                      econoserve={"default_output_len": 6, "pt_reserve": 0.1})
    engine = FakeEngine(clock)
    policy = policy_of(core)
    jobs = [job(rng.randint(1, 12), rng.randint(1, 40)) for _ in range(40)]
    for j in jobs:
        core.add(j)
    due = {j.job_id: rng.randint(0, 30) for j in jobs}  # steps until it lands
    steps = 0
    while core.has_work:
        for j in jobs:
            if due[j.job_id] == steps and j.job_id in core.jobs:
                land(core, j, max(1, j.max_tokens + rng.randint(-8, 8)))
        plan = core.schedule()
        outside = core.blocks.num_used - sum(len(j.block_table) for j in policy.batch.values())
        peak = Profile([policy.lease(j) for j in policy.batch.values()], 4, True).peak
        assert peak + outside <= core.blocks.num_blocks
        core.complete(plan, engine.execute(plan))
        core.blocks.check(core.jobs.values())
        steps += 1
        assert steps < 5000
    assert all(j.num_output_tokens == j.max_tokens for j in jobs)


def test_a_gt_admitted_before_its_prediction_overruns_straight_to_it(clock: FakeClock) -> None:
    core = econo_core(clock, econoserve={"default_output_len": 4, "pt_reserve": 0.5})
    engine = FakeEngine(clock)
    policy = policy_of(core)
    j = job(4, 40)
    core.add(j)
    step(core, engine)  # its prompt
    step(core, engine)  # admitted as a GT of 4 output tokens
    assert j.job_id in policy.batch and policy.allocation(j) == 4
    land(core, j, 30)
    assert policy.allocation(j) == 4  # what the batch was admitted on
    while j.num_output_tokens < 5:
        step(core, engine)
    # One overrun took it to the prediction, not the growth rule's 4 + 4.
    assert policy.num_overruns == 1 and policy.allocation(j) == 30
    drain(core, engine)
    assert j.num_output_tokens == 40 and policy.num_overruns == 2


def test_a_late_prediction_regroups_a_waiting_gt(clock: FakeClock) -> None:
    core = econo_core(clock, econoserve={"default_output_len": 4})
    policy = policy_of(core)
    j = job(4, 40)
    core.add(j)
    j.num_computed_tokens = j.num_prompt_tokens  # as if its prompt had run
    j.output_token_ids.append(7)
    policy.pts.remove(j)
    policy.gts.add(j, policy.gt_key(j, 0.0))
    assert policy.gts.key(j)[2] == -policy.group(j) == -1
    land(core, j, 30)
    assert policy.gts.key(j) == policy.gt_key(j, clock())
    assert policy.gts.key(j)[2] == -8  # 29 tokens to go: 8 blocks of 4


def test_deadline_from_the_jct_slo(clock: FakeClock) -> None:
    cost = LinearCost(base_s=0.01, prefill_per_token_s=0.001, decode_per_seq_s=0.001)
    core = econo_core(clock, cost=cost, econoserve={"jct_slo_scale": 2.0})
    policy = policy_of(core)
    j = job(10, 50, t=1.0)
    j.predicted_output_len = 20
    expected = 1.0 + 2.0 * (cost.prefill_time(10) + 20 * cost.decode_time(8))
    assert policy.deadline(j) == pytest.approx(expected)
    j.deadline = 3.0
    assert policy.deadline(j) == 3.0
