"""The iteration driver (scheduler/iteration.py) on a fake executor."""

from __future__ import annotations

import pytest

from scheduler.core import SchedulerCore
from scheduler.iteration import Iteration, IterationDriver, IterationFailed, OnWallClock
from scheduler.plan import Plan, StepResult
from tests.scheduler.conftest import FakeClock, FakeEngine, make_core, make_job


class FakeExecutor:
    """`FakeEngine` as an executor that records what the driver asks of it.

    Its wait reports every swap-in still in flight as landed (as the
    simulator's clock jump does), unless `land_on_wait` is False."""

    def __init__(self, engine: FakeEngine, core: SchedulerCore, land_on_wait: bool = True,
                 fail_on: str | None = None) -> None:
        self.engine = engine
        self.core = core
        self.land_on_wait = land_on_wait
        self.fail_on = fail_on
        self.removed: list[str] = []
        # (plan step, whether the plan had chunks, whether the core had work)
        # at each wait.
        self.waits: list[tuple[int, bool, bool]] = []

    def execute(self, plan: Plan) -> StepResult:
        if any(c.job_id == self.fail_on for c in plan.chunks):
            raise ValueError("device lost")
        return self.engine.execute(plan)

    def remove_request(self, job_id: str) -> None:
        assert job_id not in self.core.jobs, f"{job_id} removed while the core still has it"
        self.removed.append(job_id)

    def wait_for_swaps(self, plan: Plan, result: StepResult) -> StepResult:
        self.waits.append((plan.step, bool(plan.chunks), self.core.has_work))
        if self.land_on_wait:
            landed = [j for _, j in self.engine.in_flight]
            self.engine.in_flight.clear()
            return StepResult(result.step, result.outputs, result.iteration_time,
                              swaps_in_done=result.swaps_in_done + landed)
        return result


def drive(core: SchedulerCore, ex: FakeExecutor, max_steps: int = 2000) -> list[Iteration]:
    driver = IterationDriver(core, ex)
    its: list[Iteration] = []
    while core.has_work:
        its.append(driver.step())
        assert len(its) < max_steps, "did not drain"
    return its


def swapping_core(clock: FakeClock) -> SchedulerCore:
    """Three jobs whose KV does not fit at once: reactive swapping (without
    the prefix cache, which would give some blocks back without a copy)."""
    core = make_core(clock, num_blocks=16, block_size=4, max_model_len=64,
                     swap_mode="reactive", host_kv_blocks=64, prefix_caching=False)
    for i in range(3):
        core.add(make_job(8, 16, job_id=f"s{i}"))
    return core


def test_finished_jobs_are_removed_once_in_their_last_step(clock):
    core = make_core(clock, max_batch_size=4)
    for jid, n in (("short", 2), ("mid", 4), ("long", 6)):
        core.add(make_job(4, n, job_id=jid))
    ex = FakeExecutor(FakeEngine(clock), core)
    driver = IterationDriver(core, ex)
    removed_at: dict[str, int] = {}
    while core.has_work:
        before = len(ex.removed)
        it = driver.step()
        finished = [e.job_id for e in it.events if e.finished]
        # Removed in the very step that finished them, in event order.
        assert ex.removed[before:] == finished
        for jid in finished:
            removed_at[jid] = it.plan.step
    assert sorted(ex.removed) == ["long", "mid", "short"]
    assert removed_at["short"] < removed_at["mid"] < removed_at["long"]


def test_events_are_the_cores_tokens(clock):
    core = make_core(clock, max_batch_size=1)
    a, b = make_job(4, 3, job_id="a"), make_job(4, 2, job_id="b")
    core.add(a)
    core.add(b)
    its = drive(core, FakeExecutor(FakeEngine(clock), core))
    got: dict[str, list[int]] = {"a": [], "b": []}
    for it in its:
        for ev in it.events:
            assert ev.token_id is not None
            got[ev.job_id].append(ev.token_id)
    assert got == {"a": a.output_token_ids, "b": b.output_token_ids}
    assert got["a"] == [1000, 1001, 1002] and got["b"] == [1000, 1001]
    # Batch of one: b waited behind a until a finished.
    assert [it.num_waiting for it in its[:3]] == [1, 1, 1]
    assert its[-1].num_waiting == 0


def test_swap_wait_runs_exactly_on_chunkless_plans_while_work_remains(clock):
    core = swapping_core(clock)
    engine = FakeEngine(clock, swap_delay=3)
    ex = FakeExecutor(engine, core, land_on_wait=False)
    its = drive(core, ex)
    expected = [it.plan.step for it in its if not it.plan.chunks]
    assert expected, "the scenario never waited on a swap-in"
    # Every chunkless plan here left work behind (the last plan computes).
    assert all(has_work and not chunks for _, chunks, has_work in ex.waits)
    assert [step for step, _, _ in ex.waits] == expected
    assert [it.waited for it in its] == [not it.plan.chunks for it in its]
    assert engine.swapped_out_blocks > 0
    assert engine.swapped_in_blocks == engine.swapped_out_blocks


def test_what_the_wait_reports_reaches_the_core(clock):
    core = swapping_core(clock)
    its_slow = drive(core, FakeExecutor(FakeEngine(clock, swap_delay=3), core, land_on_wait=False))

    clock2 = FakeClock()
    core2 = swapping_core(clock2)
    ex = FakeExecutor(FakeEngine(clock2, swap_delay=3), core2, land_on_wait=True)
    its = drive(core2, ex)
    waited = [it for it in its if it.waited]
    assert waited
    # The landings the wait reported are in the recorded result, and the
    # core saw them: each such job resumes without another empty plan.
    assert all(it.result.swaps_in_done for it in waited)
    for it in waited:
        for jid in it.result.swaps_in_done:
            job = core2.jobs.get(jid)
            assert job is None or job.swap_pending is None
    assert len(waited) < sum(it.waited for it in its_slow)
    assert len(its) < len(its_slow)


def test_no_wait_once_no_work_is_left(clock):
    core = swapping_core(clock)
    engine = FakeEngine(clock, swap_delay=50)
    ex = FakeExecutor(engine, core)
    driver = IterationDriver(core, ex)
    while core.swap.host_used == 0:
        driver.step()
    for jid in list(core.jobs):
        core.abort(jid)
    assert not core.has_work and core.swap.pending_ops
    it = driver.step()
    # A plan of host-copy drops alone, with nobody left to wait for.
    assert it.plan.block_ops and not it.plan.chunks
    assert not it.waited and ex.waits == []


def test_execute_failure_leaves_the_plan_to_the_caller(clock):
    core = make_core(clock, max_batch_size=4)
    for jid in ("ok", "bad"):
        core.add(make_job(4, 3, job_id=jid))
    ex = FakeExecutor(FakeEngine(clock), core, fail_on="bad")
    driver = IterationDriver(core, ex)
    with pytest.raises(IterationFailed) as info:
        driver.step()
    failed = info.value
    assert isinstance(failed.__cause__, ValueError)
    assert sorted(c.job_id for c in failed.plan.chunks) == ["bad", "ok"]
    # Not completed: no token, nothing removed, both still the core's.
    assert all(core.jobs[j].num_computed_tokens == 0 for j in ("ok", "bad"))
    assert ex.removed == [] and ex.waits == []


def test_planned_at_and_trace(clock):
    core = make_core(clock)
    core.add(make_job(4, 1, job_id="a"))
    clock.t = 7.5
    it = IterationDriver(core, FakeExecutor(FakeEngine(clock, step_time=0.25), core)).step()
    assert it.planned_at == 7.5 and clock() == 7.75
    rec = it.trace()
    assert rec is not None and (rec.t, rec.jobs, rec.iteration_time) == (7.5, ("a",), 0.25)
    idle = Iteration(Plan(step=9), StepResult(9, [], 0.0), [], 8.0, 0, True)
    assert idle.trace() is None
    landed = Iteration(Plan(step=9), StepResult(9, [], 0.0, swaps_in_done=["a"]), [], 8.0, 0, True)
    assert landed.trace() is not None and landed.trace().landed == ("a",)


def test_on_wall_clock_sleeps_and_passes_through(monkeypatch):
    calls: list[object] = []

    class Runner:
        def execute(self, plan: Plan) -> StepResult:
            calls.append(plan)
            return StepResult(plan.step, [], 0.5)

        def remove_request(self, job_id: str) -> None:
            calls.append(job_id)

    slept: list[float] = []
    monkeypatch.setattr("scheduler.iteration.time.sleep", slept.append)
    ex = OnWallClock(Runner(), wait_s=0.002)
    plan = Plan(step=3)
    res = ex.execute(plan)
    ex.remove_request("x")
    assert calls == [plan, "x"]
    assert ex.wait_for_swaps(plan, res) is res and slept == [0.002]


def test_plan_and_completion_times_are_measured_apart(clock):
    """`plan_s` covers `schedule` alone and `complete_s` covers `complete`
    with the removal of finished jobs, on the driver's timer (not the
    core's clock)."""
    now = [0.0]
    core = make_core(clock, max_batch_size=4)
    for jid, n in (("a", 1), ("b", 3)):
        core.add(make_job(4, n, job_id=jid))
    ex = FakeExecutor(FakeEngine(clock), core)
    schedule, complete, remove = core.schedule, core.complete, ex.remove_request

    def slow_schedule():
        now[0] += 0.003
        return schedule()

    def slow_complete(plan, result):
        now[0] += 0.002
        return complete(plan, result)

    def slow_remove(job_id):
        now[0] += 0.0005
        remove(job_id)

    core.schedule = slow_schedule  # type: ignore[method-assign]
    core.complete = slow_complete  # type: ignore[method-assign]
    ex.remove_request = slow_remove  # type: ignore[method-assign]
    driver = IterationDriver(core, ex, timer=lambda: now[0])
    its = []
    while core.has_work:
        its.append(driver.step())
    assert its
    for it in its:
        finished = sum(ev.finished for ev in it.events)
        assert it.plan_s == pytest.approx(0.003)
        assert it.complete_s == pytest.approx(0.002 + 0.0005 * finished)
