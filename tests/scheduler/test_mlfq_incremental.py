"""The MLFQ's incremental planning structures against planning from scratch.

`MLFQPolicy` keeps jobs holding KV in ENST order across plans
(`scheduler/policies/ranked.py`), walks the queues lazily, skips jobs that
cannot get blocks and narrows the walk to resident jobs once no block can be
had.  The reference below re-sorts every holder by its full ENST key each
plan and walks every job: the two must produce the very same plans.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest

from scheduler.config import MLFQConfig, SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.cost import LinearCost
from scheduler.job import Job
from scheduler.policies import POLICIES
from scheduler.policies.enst import EnstRanking
from scheduler.policies.mlfq import MLFQPolicy
from scheduler.policies.walk import Walk
from tests.scheduler.conftest import FakeEngine, make_job

COST = LinearCost(base_s=0.010, prefill_per_token_s=0.001, decode_per_seq_s=0.001)


class _SortedEachPlan:
    """A `RankedSet` stand-in: members sorted by the full key every time."""

    def __init__(self, members: Callable[[], dict[str, Job]], policy: MLFQPolicy) -> None:
        self._members = members
        self._policy = policy
        self._snapshot: list[Job] = []

    def sync(self, *args: object) -> None:
        self._snapshot = [j for j in self._members().values() if j.job_id in self._policy.level]

    def __contains__(self, job_id: object) -> bool:
        return False

    def discard(self, job_id: str) -> None:
        pass

    def ran(self, *args: object) -> None:
        pass

    def ranked_after(self, rank: tuple[int, int, int]) -> list[Job]:
        ranks = self._policy._rank
        return sorted((j for j in self._snapshot if ranks[j.job_id] > rank),
                      key=lambda j: ranks[j.job_id])

    def ascending(self, ranking: EnstRanking, keep: Callable[[Job], bool]) -> Iterator[Job]:
        return iter([j for j in sorted(self._snapshot, key=ranking.key) if keep(j)])

    def descending(self, ranking: EnstRanking, keep: Callable[[Job], bool]) -> Iterator[Job]:
        return iter([j for j in sorted(self._snapshot, key=ranking.key, reverse=True)
                     if keep(j)])


class ReferenceMLFQ(MLFQPolicy):
    name = "mlfq-from-scratch"
    skip_hopeless = False

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._resident = _SortedEachPlan(lambda: self.blocks.holding, self)  # type: ignore[assignment]
        self._host = _SortedEachPlan(lambda: self.swap.on_host, self)  # type: ignore[assignment]

    def walk(self) -> Walk:
        return Walk(sorted(self.jobs(), key=self._walk_rank), self._walk_rank)


@pytest.fixture(autouse=True)
def _register() -> Iterator[None]:
    POLICIES[ReferenceMLFQ.name] = ReferenceMLFQ
    yield
    POLICIES.pop(ReferenceMLFQ.name, None)


def _core(clock, policy: str, mode: str, starvation_s: float | None) -> SchedulerCore:
    cfg = SchedulerConfig(policy=policy, block_size=4, num_blocks=96, max_batch_size=6,
                          max_batch_tokens=64, max_model_len=192, swap_mode=mode,
                          host_kv_blocks=160, mlfq=MLFQConfig(starvation_s=starvation_s))
    return SchedulerCore(cfg, clock, cost=COST)


def _fingerprint(plan) -> tuple:
    return (
        [(c.job_id, c.start_pos, c.num_tokens, tuple(c.block_table), c.sample) for c in plan.chunks],
        [(op.kind.value, op.job_id, op.first_block, tuple(op.device_blocks))
         for op in plan.block_ops],
        list(plan.preempted),
    )


def _run(policy: str, mode: str, seed: int, starvation_s: float | None,
         classes: list[int]) -> tuple[list[tuple], list[str]]:
    from tests.scheduler.conftest import FakeClock

    rng = random.Random(seed)
    clock = FakeClock()
    core = _core(clock, policy, mode, starvation_s)
    engine = FakeEngine(clock, step_time=0.011, swap_delay=rng.choice([0, 1, 2]))
    prints: list[tuple] = []
    finished: list[str] = []
    n = 0
    for step in range(1200):
        if step < 600 and rng.random() < 0.35:
            core.add(make_job(rng.randint(2, 90), rng.randint(1, 70), job_id=f"s{seed}-{n}",
                              priority=rng.choice(classes)))
            n += 1
        if core.jobs and rng.random() < 0.01:
            core.abort(rng.choice(sorted(core.jobs)))
        if not core.has_work:
            break
        plan = core.schedule()
        prints.append(_fingerprint(plan))
        events = core.complete(plan, engine.execute(plan))
        finished += [e.job_id for e in events if e.finished]
        core.blocks.check(core.jobs.values())
        assert set(core.swap.on_host) == {j.job_id for j in core.jobs.values()
                                          if j.num_host_blocks}
        # What a proactive walk leaves out.
        assert core.swap.host_only == {j.job_id for j in core.swap.on_host.values()
                                       if j.swap_pending is None and not j.block_table}
        pol = core.policy
        if pol._walk_order is not None:  # caught up as the next walk will be
            pol._sync_walk_order(pol._walk_order, pol._host_only_changed)
            assert [j.job_id for j in pol._walk_order.jobs()] == [
                j.job_id for j in pol.jobs() if j.job_id not in core.swap.host_only]
    return prints, finished


@pytest.mark.parametrize("mode", ["proactive", "reactive", "recompute"])
@pytest.mark.parametrize("starvation_s", [None, 0.3])
@pytest.mark.parametrize("classes", [[0], [0, 1, 3]])
def test_incremental_plans_equal_plans_from_scratch(mode, starvation_s, classes):
    for seed in range(3):
        ours, ours_done = _run("mlfq", mode, seed, starvation_s, classes)
        ref, ref_done = _run(ReferenceMLFQ.name, mode, seed, starvation_s, classes)
        assert len(ours) == len(ref)
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert a == b, f"seed {seed}: plans differ at step {i}"
        assert ours_done == ref_done


def _ranked_set(rng: random.Random, num_jobs: int = 60, num_members: int = 40,
                top_level: int = 5):
    """A `RankedSet` of `num_members` of `num_jobs` jobs with random levels
    (0 to `top_level`) and last runs."""
    from scheduler.policies.ranked import RankedSet

    rs = RankedSet()
    jobs = {f"j{i}": make_job(4, 4, job_id=f"j{i}") for i in range(num_jobs)}
    rank = {jid: (0, rng.randint(0, top_level), i) for i, jid in enumerate(jobs)}
    last_run = {jid: rng.random() for jid in jobs}
    members = dict(list(jobs.items())[:num_members])
    rs.sync(members, rank, last_run)
    return rs, jobs, rank, last_run, members


def _by_level(entries):
    out = {}
    for e in entries:
        out.setdefault(e[1], []).append(e)
    return out


def _run_orders(rs):
    """A `RankedSet`'s last-run orders, one per level that has members."""
    return {lvl: at for lvl, at in rs._runs_at.items() if at}


def test_ranked_set_keeps_both_orders_sorted_through_updates():
    rng = random.Random(7)
    rs, jobs, rank, last_run, members = _ranked_set(rng)
    t = 1.0
    for step in range(500):
        jid = rng.choice(list(jobs))
        if rng.random() < 0.5:
            t += rng.random()
            last_run[jid] = t  # ran: later than everyone
        else:
            rank[jid] = (0, rng.randint(0, 5), 1000 + step)  # moved level
        rs.update(jid, rank[jid], last_run[jid])
        if rng.random() < 0.1:
            members = {k: jobs[k] for k in rng.sample(list(jobs), 40)}
            rs.sync(members, rank, last_run)
        assert rs._by_rank == sorted((rank[k], k) for k in members)
        assert _run_orders(rs) == _by_level(
            sorted((last_run[k], rank[k][1], rank[k][2], k) for k in members))


@pytest.mark.parametrize("num_jobs, num_members, top_level, max_batch, steps",
                         [(60, 40, 5, 20, 300), (1000, 900, 2, 12, 60)])
def test_ranked_set_batch_runs_keep_the_last_run_order_sorted(
        num_jobs, num_members, top_level, max_batch, steps):
    """`RankedSet.ran`: a batch (members and others) ran at one time, as
    one `update` per job would leave it, also where a member that joined
    at that same time ranks after some of the batch.  The second case's
    orders are many times the batch (a GPU-sized pool's), where the old
    entries go by bisection and slices rather than by reading every one."""
    rng = random.Random(11)
    rs, jobs, rank, last_run, members = _ranked_set(rng, num_jobs, num_members, top_level)
    t = 1.0
    ties = 0
    for _ in range(steps):
        t += rng.random()
        if rng.random() < 0.3:
            # A job joins having run at t (an arrival), then a batch runs at t.
            joiner = rng.choice([k for k in jobs if k not in members])
            last_run[joiner] = t
            members[joiner] = jobs[joiner]
            rs.sync(members, rank, last_run)
        batch = rng.sample(list(jobs), rng.randint(1, max_batch))
        for jid in batch:
            last_run[jid] = t
        before = [e for at in rs._runs_at.values() for e in at]
        rs.ran(batch, t)
        ties += any(e[0] == t and e[3] not in batch for e in before)
        assert rs._by_rank == sorted((rank[k], k) for k in members)
        assert _run_orders(rs) == _by_level(
            sorted((last_run[k], rank[k][1], rank[k][2], k) for k in members))
        if rng.random() < 0.1:
            members = {k: jobs[k] for k in rng.sample(list(jobs), num_members)}
            rs.sync(members, rank, last_run)
    assert ties  # the insertion branch ran


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ran_since", [False, True])
def test_ranked_set_enst_orders_match_sorting_by_the_full_key(seed, ran_since):
    """Ascending and descending ENST orders against a sort by
    `EnstRanking.key`, where T_promote beats T_execute for some members,
    ties T_execute exactly for some, and whole levels have T_execute above
    α (the merge's cut).  Every member ran less than α ago, as in a plan:
    the policy promotes a job idle for α before it ranks anyone.  Members
    share their last runs (eight times), as a batch's do.  `ran_since`: the
    third that ran last joined with an older last run and reached theirs by
    batches (`RankedSet.ran`)."""
    from scheduler.policies.ranked import RankedSet

    rng = random.Random(seed)
    alpha, now = 1.0, 10.0
    row = [0.0, 0.0, 0.25, 0.5, 0.75, 1.5, 4.0]  # levels 5 and 6 exceed α
    jobs = {f"j{i}": make_job(4, 4, job_id=f"j{i}") for i in range(80)}
    rank = {jid: (0, rng.randint(0, len(row) - 1), i) for i, jid in enumerate(jobs)}
    # Last runs on a grid of 1/8 s: T_promote = α - (now - t) is exact, so
    # some equal their level's T_execute.
    last_run = {jid: now - rng.randint(0, 7) / 8 for jid in jobs}
    rs = RankedSet()
    # Those that ran last, so that each batch runs no earlier than any
    # member last ran (`ran`'s contract).
    threshold = sorted(last_run.values())[2 * len(jobs) // 3]
    later = [jid for jid in jobs if last_run[jid] >= threshold]
    rs.sync(jobs, rank, {**last_run, **{jid: now - 2.0 for jid in later}} if ran_since
            else last_run)
    if ran_since:
        for t in sorted({last_run[jid] for jid in later}):
            rs.ran([jid for jid in later if last_run[jid] == t], t)
    ranking = EnstRanking({0: row}, rank, last_run, alpha, now, promotes=True)
    assert not ranking.walk_order and ranking.single_class
    keys = {jid: ranking.key(j) for jid, j in jobs.items()}
    assert any(k[1] < row[rank[jid][1]] for jid, k in keys.items())  # promoted ENSTs
    assert any(rank[jid][1] >= 5 for jid in jobs)
    assert any(alpha - (now - last_run[jid]) == row[rank[jid][1]] > 0 for jid in jobs)
    keep = lambda j: int(j.job_id[1:]) % 7 != 3  # noqa: E731
    want = [j.job_id for j in sorted(jobs.values(), key=ranking.key) if keep(j)]
    assert [j.job_id for j in rs.ascending(ranking, keep)] == want
    assert [j.job_id for j in rs.descending(ranking, keep)] == want[::-1]
