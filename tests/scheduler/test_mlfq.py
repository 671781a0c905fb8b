"""Skip-join MLFQ and proactive swapping on a fake clock (FastServe §4)."""

from __future__ import annotations

import random

import pytest

from scheduler.config import MLFQConfig
from scheduler.cost import LinearCost
from scheduler.core import SchedulerCore
from scheduler.config import SchedulerConfig
from scheduler.plan import BlockOpKind
from tests.scheduler.conftest import FakeEngine, make_job

# prefill(n) = 10 ms + 1 ms/token; decode(b) = 10 ms + 1 ms/job.
COST = LinearCost(base_s=0.010, prefill_per_token_s=0.001, decode_per_seq_s=0.001)


def mlfq_core(clock, policy="mlfq", mlfq=None, **kw) -> SchedulerCore:
    cfg = dict(policy=policy, block_size=4, num_blocks=64, max_batch_size=8,
               max_batch_tokens=256, max_model_len=256)
    cfg.update(kw)
    cfg["mlfq"] = mlfq or MLFQConfig()
    return SchedulerCore(SchedulerConfig(**cfg), clock, cost=COST)


def drain(core, engine, max_steps=50_000):
    plans = []
    while core.has_work:
        p = core.schedule()
        plans.append(p)
        core.complete(p, engine.execute(p))
        core.blocks.check()
        assert len(plans) < max_steps
    return plans


def test_quanta_start_at_min_iteration_time_and_double(clock):
    pol = mlfq_core(clock).policy
    assert pol.quanta[0] == pytest.approx(COST.decode_time(1))
    assert all(b == pytest.approx(2 * a) for a, b in zip(pol.quanta, pol.quanta[1:]))


def test_skip_join_places_by_predicted_prefill_time(clock):
    core = mlfq_core(clock)
    pol = core.policy
    # q = 11, 22, 44, 88, 176, 352 ms.
    short, mid, long = make_job(5, 4), make_job(40, 4), make_job(200, 4)
    for j in (short, mid, long):
        core.add(j)
    assert pol.level[short.job_id] == 1  # 15 ms -> q2 = 22 ms
    assert pol.level[mid.job_id] == 3    # 50 ms -> q4 = 88 ms
    assert pol.level[long.job_id] == 5   # 210 ms -> q6 = 352 ms (q5 = 176 ms)


def test_naive_mlfq_puts_everyone_in_q1(clock):
    core = mlfq_core(clock, policy="mlfq-naive")
    j = make_job(200, 4)
    core.add(j)
    assert core.policy.level[j.job_id] == 0


def test_demotion_chain_follows_quanta(clock):
    core = mlfq_core(clock, mlfq=MLFQConfig(starvation_s=100.0))
    job = make_job(4, 200)
    core.add(job)
    engine = FakeEngine(clock, step_time=0.0115)
    levels = []
    for _ in range(60):
        p = core.schedule()
        core.complete(p, engine.execute(p))
        levels.append(core.policy.level[job.job_id])
    assert levels == sorted(levels)  # only ever demoted
    # The job joins Q2 (prefill 14 ms > q1 = 11 ms) and moves down one level
    # after 2, 4, 8, ... iterations of 11.5 ms (quanta 22, 44, 88 ms).
    first = levels[0]
    changes = [i for i in range(1, len(levels)) if levels[i] != levels[i - 1]]
    assert first == 1
    assert changes[:3] == [1, 5, 13]
    assert core.policy.num_demotions == len(changes)


def test_a_prompt_split_across_iterations_keeps_its_queue_until_its_first_token(clock):
    """Two 64-token iterations of 100 ms each.  A (100 tokens) and B (60)
    both join Q4 (a 64-token prefill: 74 ms, q4 = 88 ms).  A's first chunk
    fills the first iteration; charged that iteration's 100 ms it would be
    demoted and B would start ahead of A's last 36 tokens.  Charged its own
    chunk's prefill (74 ms), A finishes its prompt in the second iteration."""
    core = mlfq_core(clock, max_batch_tokens=64, mlfq=MLFQConfig(starvation_s=100.0))
    engine = FakeEngine(clock, step_time=0.1)
    a, b = make_job(100, 4, job_id="A"), make_job(60, 4, job_id="B")
    core.add(a)
    core.add(b)
    assert core.policy.level["A"] == core.policy.level["B"] == 3
    first = core.schedule()
    core.complete(first, engine.execute(first))
    assert [(c.job_id, c.num_tokens, c.sample) for c in first.chunks] == [("A", 64, False)]
    assert core.policy.level["A"] == 3
    second = core.schedule()
    assert [(c.job_id, c.num_tokens, c.sample) for c in second.chunks] == [
        ("A", 36, True), ("B", 28, False)]
    core.complete(second, engine.execute(second))
    # The iteration that sampled A's first token is charged whole: A moves down.
    assert core.policy.level["A"] > 3


def test_a_prompt_longer_than_its_quantum_is_still_demoted_while_prefilling(clock):
    """A 400-token prompt joins by its first 64-token chunk (74 ms, Q4 of
    88 ms); its chunks' own prefill time overruns that quantum at the
    second: a long prompt is a long job, and moves down before its end."""
    core = mlfq_core(clock, max_batch_tokens=64, max_model_len=512, num_blocks=128,
                     mlfq=MLFQConfig(starvation_s=100.0))
    engine = FakeEngine(clock, step_time=0.1)
    job = make_job(400, 4, job_id="long")
    core.add(job)
    levels = []
    while not job.output_token_ids:
        p = core.schedule()
        core.complete(p, engine.execute(p))
        levels.append(core.policy.level["long"])
    assert levels[0] == 3 and levels[1] > 3
    assert len(levels) == 7  # 400 tokens in 64-token iterations


def test_starved_job_is_promoted_to_q1(clock):
    core = mlfq_core(clock, max_batch_size=1, mlfq=MLFQConfig(starvation_s=0.2))
    engine = FakeEngine(clock, step_time=0.011)
    hog = make_job(4, 500, job_id="hog")
    core.add(hog)
    for _ in range(30):  # hog gets demoted a few levels
        p = core.schedule()
        core.complete(p, engine.execute(p))
    victim_level = core.policy.level["hog"]
    assert victim_level >= 2
    # A stream of short jobs keeps the single batch slot busy.
    ran_hog_at = None
    for i in range(200):
        if i % 3 == 0:
            core.add(make_job(4, 3))
        p = core.schedule()
        if any(c.job_id == "hog" for c in p.chunks):
            ran_hog_at = clock()
            break
        core.complete(p, engine.execute(p))
    assert ran_hog_at is not None, "starved job never ran"
    assert core.policy.num_promotions >= 1
    assert ran_hog_at < 0.33 + 0.2 + 0.05


def test_alpha_derives_from_the_normalized_latency_slo(clock):
    # Default: the whole budget of a max_model_len job under FastServe's SLO
    # of 10 batch-1 decode iterations per token (§6.1): 10 * 11 ms * 256.
    assert mlfq_core(clock).policy.alpha == pytest.approx(10 * COST.decode_time(1) * 256)
    slo = MLFQConfig(slo_normalized_s=0.05)
    assert mlfq_core(clock, mlfq=slo).policy.alpha == pytest.approx(0.05 * 256)
    explicit = MLFQConfig(slo_normalized_s=0.05, starvation_s=3.0)
    assert mlfq_core(clock, mlfq=explicit).policy.alpha == 3.0


def test_default_alpha_lets_a_long_job_wait_behind_a_stream_of_short_ones(clock):
    # Within its budget a demoted job is not promoted: the short jobs that
    # keep arriving all finish first (no round robin over the backlog).
    core = mlfq_core(clock, max_batch_size=1)
    engine = FakeEngine(clock, step_time=0.011)
    core.add(make_job(4, 500, job_id="hog"))
    for _ in range(30):
        p = core.schedule()
        core.complete(p, engine.execute(p))
    for i in range(300):  # 3.3 s, far below α = 28 s
        if i % 3 == 0:
            core.add(make_job(4, 3))
        p = core.schedule()
        assert all(c.job_id != "hog" for c in p.chunks)
        core.complete(p, engine.execute(p))
    assert core.policy.num_promotions == 0


def test_short_job_overtakes_long_one_unlike_fcfs(clock):
    def finish_of_short(policy: str) -> float:
        from tests.scheduler.conftest import FakeClock

        c = FakeClock()
        core = mlfq_core(c, policy=policy, max_batch_size=1)
        engine = FakeEngine(c, step_time=0.011)
        long, short = make_job(4, 300, job_id="long"), make_job(4, 5, job_id="short")
        core.add(long)
        for _ in range(3):
            p = core.schedule()
            core.complete(p, engine.execute(p))
        core.add(short)
        while "short" in core.jobs:
            p = core.schedule()
            core.complete(p, engine.execute(p))
        return short.finish_time

    assert finish_of_short("mlfq") < finish_of_short("fcfs") / 10


def test_queue_count_covers_max_model_len(clock):
    for max_len, expect in ((256, 9), (1024, 11), (2048, 12)):
        pol = mlfq_core(clock, max_model_len=max_len, num_blocks=max_len // 4).policy
        assert len(pol.quanta) == expect
        assert pol.quanta[-1] >= max_len * pol.quanta[0] > pol.quanta[-2]
    pol = mlfq_core(clock, mlfq=MLFQConfig(num_queues=3)).policy
    assert len(pol.quanta) == 3


def test_medium_job_overtakes_older_long_one_after_many_tokens(clock):
    """A 60-token job arriving behind a 200-token one finishes first: with
    enough queues it is never in the same FIFO as the older, longer job.
    With three queues both reach the last one and FIFO order returns."""

    def order(mlfq: MLFQConfig) -> list[str]:
        from tests.scheduler.conftest import FakeClock

        c = FakeClock()
        core = mlfq_core(c, mlfq=mlfq, max_batch_size=1)
        engine = FakeEngine(c, step_time=0.011)
        core.add(make_job(4, 200, job_id="long"))
        for _ in range(100):
            p = core.schedule()
            core.complete(p, engine.execute(p))
        core.add(make_job(4, 60, job_id="medium"))
        done: list[str] = []
        while core.has_work:
            before = set(core.jobs)
            p = core.schedule()
            core.complete(p, engine.execute(p))
            done += sorted(before - set(core.jobs))
        return done

    assert order(MLFQConfig(starvation_s=100.0)) == ["medium", "long"]
    assert order(MLFQConfig(starvation_s=100.0, num_queues=3)) == ["long", "medium"]


def test_enst_orders_by_level_and_starvation(clock):
    core = mlfq_core(clock, mlfq=MLFQConfig(starvation_s=1.0))
    pol = core.policy
    a, b, c = make_job(4, 10), make_job(40, 10), make_job(200, 10)
    for j in (a, b, c):
        core.add(j)
    e = pol.enst(clock())
    assert e[a.job_id] < e[b.job_id] < e[c.job_id]
    # c is about to be promoted: its ENST drops to the time left.
    clock.advance(0.999)
    e = pol.enst(clock())
    assert e[c.job_id] == pytest.approx(0.001, abs=1e-6)


def _swap_workload(clock, mode, seed=0, host=256, **kw):
    rng = random.Random(seed)
    core = mlfq_core(clock, num_blocks=40, max_batch_size=4, swap_mode=mode,
                     host_kv_blocks=host, max_model_len=128, **kw)
    engine = FakeEngine(clock, step_time=0.011, swap_delay=1)
    jobs = []
    plans = []
    for step in range(3000):
        if step < 300 and rng.random() < 0.15:
            j = make_job(rng.randint(4, 40), rng.randint(4, 60))
            jobs.append(j)
            core.add(j)
        if step >= 300 and not core.has_work:
            break
        p = core.schedule()
        plans.append(p)
        core.complete(p, engine.execute(p))
        core.blocks.check()
    assert not core.has_work
    for j in jobs:  # swapped blocks came back intact (FakeEngine asserts it)
        assert j.output_token_ids == [1000 + k for k in range(j.max_tokens)]
    return core, engine, plans


@pytest.mark.parametrize("copy_rate", [None, 200.0])
def test_proactive_swap_ins_stay_within_what_the_link_copies_in_an_iteration(clock, copy_rate):
    """FastServe §4.2 overlaps the swaps with the computation: a plan's
    swap-ins are at most what the host tier's link copies while an
    iteration computes (the engine's measured blocks/s times the last
    iteration's time; 200 × 11 ms: 2 blocks), 1/8 of the device blocks (16)
    while no rate is known, and a plan's first job goes whatever its size."""
    rng = random.Random(0)
    core = mlfq_core(clock, num_blocks=128, max_batch_size=4, swap_mode="proactive",
                     host_kv_blocks=2048, max_model_len=128)
    engine = FakeEngine(clock, step_time=0.011, swap_delay=1)
    sizes: list[int] = []
    for step in range(4000):
        if step < 400 and rng.random() < 0.3:
            core.add(make_job(rng.randint(4, 40), rng.randint(4, 60)))
        if step >= 400 and not core.has_work:
            break
        p = core.schedule()
        ins = [op.job_id for op in p.block_ops if op.kind is BlockOpKind.SWAP_IN
               for _ in op.device_blocks]  # a block each
        if ins:
            cap = 16 if core.swap.copy_rate is None else int(copy_rate * 0.011)
            assert len(ins) <= cap or len(set(ins)) == 1, (step, len(ins), cap)
            sizes.append(len(ins))
        result = engine.execute(p)
        result.copy_rate = copy_rate
        core.complete(p, result)
        core.blocks.check()
    assert not core.has_work and sizes
    if copy_rate is None:
        assert max(sizes) > 2  # the rate's bound below would have cut these
    else:
        assert sum(n > 2 for n in sizes) < len(sizes)  # only single large jobs pass it


@pytest.mark.parametrize("mode", ["reactive", "proactive"])
def test_swapping_never_pingpongs_and_preserves_outputs(clock, mode):
    core, engine, plans = _swap_workload(clock, mode)
    assert core.swap.num_swap_out > 0, "workload was meant to need swapping"
    for p in plans:
        out = {op.job_id for op in p.block_ops if op.kind is BlockOpKind.SWAP_OUT}
        inn = {op.job_id for op in p.block_ops if op.kind is BlockOpKind.SWAP_IN}
        assert not out & inn
    assert core.swap.host_used == 0 and engine.host == {}
    assert core.blocks.num_free == core.blocks.num_blocks


def test_proactive_swaps_out_largest_enst_first(clock):
    core = mlfq_core(clock, num_blocks=40, max_batch_size=1, swap_mode="proactive",
                     host_kv_blocks=100, reserve_blocks=8, max_model_len=128,
                     mlfq=MLFQConfig(starvation_s=100.0))
    engine = FakeEngine(clock, step_time=0.011)
    jobs = [make_job(n, 50, job_id=f"p{n}") for n in (8, 40, 60, 90)]
    for j in jobs:
        core.add(j)
    checked = 0
    while core.has_work:
        enst = core.policy.enst(clock())
        holders = [j for j in core.jobs.values() if j.block_table and j.swap_pending is None]
        p = core.schedule()
        outs = [op.job_id for op in p.block_ops if op.kind is BlockOpKind.SWAP_OUT]
        if outs:
            running = {c.job_id for c in p.chunks}
            idle = [j for j in holders if j.job_id not in running]
            assert enst[outs[0]] == max(enst[j.job_id] for j in idle)
            checked += 1
        core.complete(p, engine.execute(p))
    assert checked > 0, "the workload was meant to swap proactively"


def test_reserve_serves_a_burst_without_eviction(clock):
    core = mlfq_core(clock, num_blocks=64, max_batch_size=4, swap_mode="proactive",
                     host_kv_blocks=200, reserve_blocks=16,
                     mlfq=MLFQConfig(starvation_s=100.0))
    engine = FakeEngine(clock, step_time=0.011)
    for i in range(8):
        core.add(make_job(8, 200, job_id=f"bg{i}"))
    for _ in range(40):
        p = core.schedule()
        core.complete(p, engine.execute(p))
    assert core.blocks.num_free >= 16
    for i in range(4):  # burst: 4 jobs x 3 blocks fit the reserve
        core.add(make_job(10, 4, job_id=f"burst{i}"))
    p = core.schedule()
    assert {f"burst{i}" for i in range(4)} <= {c.job_id for c in p.chunks}
    assert not [op for op in p.block_ops if op.kind is BlockOpKind.SWAP_OUT and
                op.job_id.startswith("burst")]
    assert p.preempted == []


def test_recompute_mode_drops_instead_of_swapping(clock):
    core, engine, _ = _swap_workload(clock, "recompute")
    assert core.swap.num_swap_out == 0 and engine.swapped_out_blocks == 0
    assert core.num_preemptions > 0


def test_skip_join_by_predicted_work(clock):
    def levels(skip_join: str) -> tuple[int, int, int]:
        core = mlfq_core(clock, mlfq=MLFQConfig(skip_join=skip_join))
        short, long, unknown = make_job(8, 200), make_job(8, 200), make_job(8, 200)
        short.predicted_output_len, long.predicted_output_len = 2, 150
        for j in (short, long, unknown):
            core.add(j)
        lvl = core.policy.level
        return lvl[short.job_id], lvl[long.job_id], lvl[unknown.job_id]

    # By the first iteration alone, equal prompts join one queue.
    s, l, u = levels("prefill")
    assert s == l == u
    by_prefill = u
    # By predicted work, a long answer joins lower; no prediction: by prefill.
    s, l, u = levels("predicted")
    assert by_prefill <= s < l and u == by_prefill


def test_a_prediction_that_lands_before_the_first_run_moves_the_job(clock):
    core = mlfq_core(clock, mlfq=MLFQConfig(skip_join="predicted"))
    late, ran = make_job(8, 200), make_job(8, 200)
    core.add(late)
    core.add(ran)
    before = core.policy.level[late.job_id]
    ran.first_scheduled_time = 0.0  # it has run: it keeps its queue
    for j in (late, ran):
        j.predicted_output_len = 150
        core.policy.on_prediction(j)
    assert core.policy.level[late.job_id] > before
    assert core.policy.level[ran.job_id] == before
