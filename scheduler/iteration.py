"""One iteration of a replica: schedule, execute, complete.

The engine replica's start-up cost profile (engine/profiler.py), the bench
profiler and the simulator step through `IterationDriver.step`, and so does
the replica's loop (deployments/engine_loop.py) without `async_scheduling`,
so the simulator then runs the server's very step and differs only in its
`Executor`: a model runner on the wall clock, or a cost model on a virtual
clock (bench/sim_executor.py; docs/structures.md, "Packages").  With
`async_scheduling` (by default on cuda: `AppConfig.schedules_ahead`) the
loop runs `AheadDriver` (scheduler/ahead.py), which plans each iteration
while the previous pass is in flight; the simulator does not.

The swap-wait rule: the scheduler only schedules a job whose blocks are
resident, and a swap-in may land iterations after the plan that issued it
(proactive swapping, FastServe §4.2).  A plan without chunks while jobs
remain means everything runnable waits on such a copy; the driver then
hands the executor `wait_for_swaps`, which lets time pass until one may
have landed (the server sleeps a millisecond, the simulator jumps its
clock) instead of planning again at once.  No Ray, no torch here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from scheduler.core import JobEvent, SchedulerCore
from scheduler.plan import Plan, StepResult
from scheduler.trace import StepTrace


class Executor(Protocol):
    def execute(self, plan: Plan) -> StepResult:
        """Run `plan` (its block ops, then its forward pass)."""
        ...

    def remove_request(self, job_id: str) -> None:
        """Forget a job that finished (its per-request state)."""
        ...

    def wait_for_swaps(self, plan: Plan, result: StepResult) -> StepResult:
        """`plan` computed nothing while jobs remain: let time pass until a
        swap-in may have landed, and return `result` with any landings
        to report."""
        ...


class Runner(Protocol):
    def execute(self, plan: Plan) -> StepResult: ...
    def remove_request(self, job_id: str) -> None: ...


class OnWallClock:
    """A model runner as an `Executor` on the wall clock.

    Its swap-ins land on their own (a copy stream or thread) and are
    reported by a later `execute`, so waiting is a short sleep: long enough
    not to spin on the scheduler, short against any copy."""

    def __init__(self, runner: Runner, wait_s: float = 0.001) -> None:
        self.runner = runner
        self.wait_s = wait_s

    def execute(self, plan: Plan) -> StepResult:
        return self.runner.execute(plan)

    def remove_request(self, job_id: str) -> None:
        self.runner.remove_request(job_id)

    def wait_for_swaps(self, plan: Plan, result: StepResult) -> StepResult:
        time.sleep(self.wait_s)
        return result


class IterationFailed(RuntimeError):
    """The executor raised on `plan` (the cause is chained).  The core did
    not complete the plan: its jobs are the caller's to abort or retry."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(f"iteration {plan.step} failed")
        self.plan = plan


@dataclass(slots=True)
class Iteration:
    """What one step did, for the caller's own stats and deliveries."""

    plan: Plan
    result: StepResult
    events: list[JobEvent]
    # The core's clock when the plan was made.
    planned_at: float
    # Jobs the policy left waiting by this plan: while any, the batch ran
    # saturated (the simulator's measure of capacity).
    num_waiting: int
    # The plan computed nothing while jobs remained: `wait_for_swaps` ran.
    waited: bool
    # Seconds spent planning (`core.schedule`) and completing (`core.complete`
    # and removing finished jobs from the executor): the scheduler's share
    # of the host time of an iteration.
    plan_s: float = 0.0
    complete_s: float = 0.0

    def trace(self) -> StepTrace | None:
        """The plan's trace record, or None for a plan that did nothing
        (`StepTrace.eventful`)."""
        if not StepTrace.eventful(self.plan, self.result):
            return None
        return StepTrace.of(self.planned_at, self.plan, self.result)


class IterationDriver:
    def __init__(self, core: SchedulerCore, executor: Executor,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self.core = core
        self.executor = executor
        # Measures `Iteration.plan_s` / `complete_s` (host time, whatever
        # the core's clock is).
        self.timer = timer

    # A driver that keeps a pass in flight (scheduler/ahead.py) has one here.
    in_flight: object | None = None

    def step(self) -> Iteration:
        """Plan one iteration, run it, complete it, and remove the jobs it
        finished from the executor.  Raises `IterationFailed` if the
        executor does; anything else the core or the wait raises passes
        through unchanged."""
        core, timer = self.core, self.timer
        planned_at = core.clock()
        t0 = timer()
        plan = core.schedule()
        plan_s = timer() - t0
        return self._run(plan, planned_at, core.policy.num_waiting(), plan_s)

    def steps(self) -> list[Iteration]:
        """The iterations completed by one call: here always one."""
        return [self.step()]

    def drain(self) -> list[Iteration]:
        """Complete whatever is in flight: nothing, here."""
        return []

    def _run(self, plan: Plan, planned_at: float, num_waiting: int,
             plan_s: float) -> Iteration:
        core, timer = self.core, self.timer
        try:
            # A plan without chunks still carries block ops, and its result
            # reports swap-ins that landed meanwhile.
            result = self.executor.execute(plan)
        except Exception as e:
            raise IterationFailed(plan) from e
        waited = not plan.chunks and core.has_work
        if waited:
            result = self.executor.wait_for_swaps(plan, result)
        t0 = timer()
        events = core.complete(plan, result)
        for ev in events:
            if ev.finished:
                self.executor.remove_request(ev.job_id)
        return Iteration(plan, result, events, planned_at, num_waiting, waited,
                         plan_s, timer() - t0)
