"""Planning iteration N+1 while the device runs iteration N.

On a GPU a decode step's device time is a few milliseconds, about what the
host spends planning it, completing the previous one and preparing its
inputs (studies/engine_gpu).  Done one after the other, the device idles
for the host's share of every iteration.  `AheadDriver` plans and launches
the next pass before the tokens of the one in flight have come back, so the
host's work of one iteration overlaps the device's of the previous one.

The plan is made on a provisional state.  `advance` applies what launching
a pass makes certain: its chunks' KV is computed, and each sampling chunk
adds one output whose value is not known yet (`PENDING_TOKEN` in the job's
outputs, and in the next decode chunk, which the engine fills from the
previous pass's sampled ids on the device), so a job that reaches
`max_tokens` or `max_model_len` finishes then and leaves the next plan.
`settle` applies the rest when the tokens land: their values, time
attained, first-token times, the policy's end-of-step hook, and finishes
only the engine can see (EOS, stop tokens and strings).  A job ended that
way may already be in the next pass: that pass's token for it is dropped.

What needs an output's value before the next pass stays synchronous: a plan
the runner may cut between layers (its tokens may never come), a plan with
no chunks (it waits on swaps), and whatever the executor refuses to run
ahead (`can_run_ahead`: sampling that reads the previous token, such as the
penalties, and logprobs read from logits the next pass overwrites).  Then
the pass in flight is settled first and the plan runs as
`IterationDriver.step` runs it.  No Ray, no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from scheduler.core import JobEvent, SchedulerCore
from scheduler.iteration import (
    Executor, Iteration, IterationDriver, IterationFailed, OnWallClock,
)
from scheduler.job import Job, JobState
from scheduler.plan import PENDING_TOKEN, Plan, ScheduledChunk, StepResult

# An enum member's lookup costs ~0.15 µs on Python 3.11: once per chunk.
_ABORTED = JobState.ABORTED


class AheadExecutor(Executor, Protocol):
    def launch(self, plan: Plan) -> Any:
        """Queue `plan`'s block ops, pass and sampling; returns a handle
        for `collect` without waiting for the device."""
        ...

    def collect(self, pending: Any) -> StepResult:
        """Wait for a launched plan's tokens and return its result."""
        ...

    def can_run_ahead(self, pending: Any, plan: Plan) -> bool:
        """Whether `plan` may be launched before `pending` is collected."""
        ...


@dataclass(slots=True)
class InFlight:
    """A launched plan whose tokens have not been settled."""

    plan: Plan
    pending: Any
    # Every chunk's job as `advance` found it (None: gone before launch),
    # and the sampling chunks that `advance` finished at max_tokens /
    # max_model_len.
    jobs: list[Job | None]
    finished_at_launch: set[str]
    planned_at: float
    num_waiting: int
    plan_s: float
    advance_s: float = 0.0


@dataclass(slots=True)
class PlanAhead:
    """The core's bookkeeping split at a pass's launch (`advance`) and at
    its tokens' landing (`settle`)."""

    core: SchedulerCore
    # Jobs ended by `settle` whose next pass was already launched: its
    # token for them is dropped when that pass settles.
    ended_early: set[str] = field(default_factory=set)

    def advance(self, plan: Plan) -> tuple[list[Job | None], set[str]]:
        core = self.core
        jobs, max_model_len = core.jobs, core.config.max_model_len
        sharing = core.sharing if core.sharing.has_groups else None
        now = core.clock()
        prefix = core.blocks.prefix
        found: list[Job | None] = []
        finished: set[str] = set()
        for chunk in plan.chunks:
            job = jobs.get(chunk.job_id)
            found.append(job)
            if job is None:
                continue
            job.num_computed_tokens += len(chunk.token_ids)
            if prefix is not None and len(chunk.token_ids) > 1:
                # As `SchedulerCore.complete` does: a job adopting these
                # blocks in the next plan reads them after this pass.
                prefix.index(job, job.num_computed_tokens)
            if sharing is not None:
                core._release_siblings(sharing.on_computed(job))
            if not chunk.sample:
                continue
            produced = job.output_token_ids
            produced.append(PENDING_TOKEN)
            if (len(produced) >= job.max_tokens
                    or len(job.prompt_token_ids) + len(produced) >= max_model_len):
                core._finish(job, "length", now)
                finished.add(job.job_id)
        return found, finished

    def settle(self, flight: InFlight, result: StepResult) -> list[JobEvent]:
        core = self.core
        now = core.clock()
        core.apply_swaps(result)
        dropped, self.ended_early = self.ended_early, set()
        outputs = {o.job_id: o for o in result.outputs}
        events: list[JobEvent] = []
        spent = result.iteration_time
        for chunk, job in zip(flight.plan.chunks, flight.jobs):
            if job is None or job.state is _ABORTED or job.job_id in dropped:
                continue
            job.attained_service += spent
            if chunk.sample:
                event = self._token(chunk, job, outputs.get(chunk.job_id),
                                    chunk.job_id in flight.finished_at_launch, now)
                events.append(event)
        core.policy.on_step_done(flight.plan, spent)
        return events

    def _token(self, chunk: ScheduledChunk, job: Job, out: Any, finished: bool,
               now: float) -> JobEvent:
        if out is None or out.token_id is None:
            raise RuntimeError(f"job {job.job_id}: no token for output {chunk.output_index}")
        produced = job.output_token_ids
        produced[chunk.output_index] = out.token_id
        if job.first_token_time is None:
            job.first_token_time = now
        reason = out.finish_reason
        if finished:
            job.finish_reason = reason or "length"
            job.finish_time = now
        elif reason is not None:
            # Ended by a token only the engine could judge: the pass launched
            # since may hold one more output for it.
            del produced[chunk.output_index + 1:]
            if job.job_id in self.core.jobs:
                self.core._finish(job, reason, now)
            else:  # finished at that pass's launch, by length
                job.finish_reason = reason
                job.finish_time = now
            self.ended_early.add(job.job_id)
        return JobEvent(job.job_id, out.token_id, out.text, finished or reason is not None,
                        job.finish_reason if finished or reason else None, out.logprobs,
                        out.prompt_logprobs, out.text_later, out.stop_reason)


class AheadDriver(IterationDriver):
    """`IterationDriver` that keeps one pass in flight (module docstring).

    `steps()` returns the iterations settled by this call: none while the
    first pass fills the pipe, one per call after, two when a plan that
    must run synchronously follows a pass in flight."""

    def __init__(self, core: SchedulerCore, executor: AheadExecutor, **kwargs: Any) -> None:
        if core.config.speculative.num_tokens:
            # Drafts are looked up in tokens the pass in flight has not
            # sampled yet (scheduler/speculation.py).
            raise ValueError("speculative decoding plans each step after the last: it does "
                             "not run ahead")
        super().__init__(core, executor, **kwargs)
        self.ahead_executor = executor
        self.books = PlanAhead(core)
        self.in_flight: InFlight | None = None
        # Passes launched while the previous one was in flight.
        self.num_ahead = 0

    def steps(self) -> list[Iteration]:
        core, timer, ex = self.core, self.timer, self.ahead_executor
        planned_at = core.clock()
        t0 = timer()
        plan = core.schedule()
        plan_s = timer() - t0
        num_waiting = core.policy.num_waiting()
        done: list[Iteration] = []
        prev = self.in_flight
        ahead = bool(plan.chunks) and not plan.preemptible_at_layers
        if prev is not None and not (ahead and ex.can_run_ahead(prev.pending, plan)):
            done.append(self._settle(prev))
            prev = None
            if self.books.ended_early:
                # Ended by the tokens just settled, after this plan was made.
                plan.chunks = [c for c in plan.chunks if c.job_id in core.jobs]
                self.books.ended_early.clear()
                ahead = ahead and bool(plan.chunks)
        if not ahead:
            if plan.is_empty and not core.has_work:
                return done  # only the pass in flight was left
            done.append(self._run(plan, planned_at, num_waiting, plan_s))
            return done
        try:
            pending = ex.launch(plan)
        except Exception as e:
            failed = plan if prev is None else Plan(plan.step, prev.plan.chunks + plan.chunks)
            self.in_flight = None
            raise IterationFailed(failed) from e
        t0 = timer()
        jobs, finished = self.books.advance(plan)
        self.in_flight = InFlight(plan, pending, jobs, finished, planned_at, num_waiting,
                                  plan_s, timer() - t0)
        if prev is not None:
            self.num_ahead += 1
            done.append(self._settle(prev))
        return done

    def drain(self) -> list[Iteration]:
        """Settle the pass in flight, if any."""
        prev = self.in_flight
        return [] if prev is None else [self._settle(prev)]

    def _settle(self, flight: InFlight) -> Iteration:
        if self.in_flight is flight:
            self.in_flight = None
        try:
            result = self.ahead_executor.collect(flight.pending)
        except Exception as e:
            raise IterationFailed(flight.plan) from e
        t0 = self.timer()
        events = self.books.settle(flight, result)
        for ev in events:
            if ev.finished:
                self.executor.remove_request(ev.job_id)
        return Iteration(flight.plan, result, events, flight.planned_at, flight.num_waiting,
                         False, flight.plan_s, flight.advance_s + self.timer() - t0)


class OnWallClockAhead(OnWallClock):
    """`OnWallClock` for a runner that can keep a pass in flight."""

    def launch(self, plan: Plan) -> Any:
        return self.runner.launch(plan)  # type: ignore[attr-defined]

    def collect(self, pending: Any) -> StepResult:
        return self.runner.collect(pending)  # type: ignore[attr-defined]

    def can_run_ahead(self, pending: Any, plan: Plan) -> bool:
        return self.runner.can_run_ahead(pending, plan)  # type: ignore[attr-defined]
