"""What a replica's iteration loop counts (`EngineLoop.stats`): iterations
and their forward, planning and completion time, tokens and preemptions per
job class, finished jobs' latencies for the dashboard, and the latest
iterations and plans for the cost table measured in place and the plan
trace.  Read by the Engine deployment's stats and metrics."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from deployments.job_metrics import FinishedJob
from scheduler.core import JobEvent
from scheduler.autoscale import online_cadence
from scheduler.cost import LinearCost
from scheduler.iteration import Iteration
from scheduler.job import Job, JobClass
from scheduler.plan import Plan
from scheduler.trace import StepTrace

# An enum member's lookup costs ~0.15 µs on Python 3.11: once per token.
_OFFLINE = JobClass.OFFLINE


@dataclass(slots=True)
class LoopStats:
    iterations: int = 0
    forward_time: float = 0.0
    # Wall time of whole iterations, inbox to delivery: the difference to
    # forward_time is the control overhead (planning, bookkeeping, delivery).
    loop_time: float = 0.0
    # Of that overhead, the scheduler's planning and its completion of each
    # plan (`Iteration.plan_s`, `complete_s`), in iterations that computed.
    plan_time: float = 0.0
    complete_time: float = 0.0
    tokens_out: int = 0
    # Speculative decoding: draft tokens verified, and those accepted.
    drafted: int = 0
    accepted: int = 0
    # Passes cut between layers for an online arrival, and their seconds.
    interrupted: int = 0
    interrupted_time: float = 0.0
    # Per job class ("online" / "offline"): tokens generated, preemptions
    # (ConServe: offline work's tokens/s and how often it gave way).
    tokens_by_class: dict[str, int] = field(default_factory=dict)
    # Offline jobs that sampled their first token: how fast the replica
    # takes offline work in (the offline pool sizes its queue by it).
    offline_started: int = 0
    # Choices resumed here after their replica failed (deployments/resume.py),
    # and their tokens (prompt and outputs) whose KV was to be rebuilt.
    resumed_jobs: int = 0
    resumed_tokens: int = 0
    # Of those tokens, the ones whose KV came from the failed replica's
    # checkpoints instead of being recomputed (`survival.checkpoint`).
    resumed_kv_tokens: int = 0
    preemptions_by_class: dict[str, int] = field(default_factory=dict)
    # Admission ids of the requests taken in since the replica's last load
    # report (scheduler/placement.py).  Bounded: a replica with no Scheduler
    # never reads them, and one dropped here only counts until it goes stale.
    arrived: deque[str] = field(default_factory=lambda: deque(maxlen=100_000))
    # Finished jobs, until the replica's reporter hands them to the
    # dashboard's figures.
    finished: deque[FinishedJob] = field(default_factory=lambda: deque(maxlen=100_000))
    # (monotonic time, seconds since the previous iteration) of each
    # iteration decoding an online job right after another: the cadence of
    # online jobs' tokens, the autoscaler's TPOT signal.
    decode_gaps: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=4096))
    # Forward times of the latest iterations, for steady-state figures.
    recent_forward: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    # The latest iterations as run here, for a cost table measured in place
    # (`python -m bench profile-live`, through `iteration_log`): each
    # chunk's start_pos, each chunk's number of tokens, forward seconds,
    # seconds from planning to completion.  Two tuples of ints a record,
    # not a pair per chunk: every object a record keeps counts towards the
    # next young collection (`engine/gc_heap.py`), and a pair per chunk
    # made most of a busy loop's collections.
    recent_iterations: deque[tuple[tuple[int, ...], tuple[int, ...], float, float]] = field(
        default_factory=lambda: deque(maxlen=20_000))
    # Every plan that did something, for comparing a live run with its
    # simulation step by step (`python -m bench trace-summary`, through
    # `plans`), as `StepTrace.row`s: plain tuples, which the collector
    # stops tracking once it has seen them, where 50,000 record objects
    # would stay for every full collection to walk.
    recent_plans: deque[tuple[Any, ...]] = field(default_factory=lambda: deque(maxlen=50_000))
    # (monotonic time, request id) of each request reaching the replica, on
    # the plans' clock: how fast a burst gets here (studies/burst/path_cpu.py),
    # which the plans alone bound only to within an iteration.
    arrival_times: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=50_000))
    # Tokens/s of whole iterations when the batch was (nearly) full: the
    # replica's speed under load, which bounds its queued work
    # (scheduler/admission.py).  None until such an iteration ran.
    full_batch_tokens_per_s: float | None = None
    # Measured over modelled time of iterations with prompt tokens (EWMA):
    # how much slower than the start-up cost model the replica runs now,
    # which scales its TTFT estimate (scheduler/admission.py).
    prefill_slowdown: float = 1.0
    # When the last iteration with decodes ended (None: idle since).
    last_decode_end: float | None = None

    def trace(self) -> dict[str, list[Any]]:
        """Every recent plan (`scheduler.trace.StepTrace` fields) and
        arrival ([time, request id]), oldest first."""
        return {"plans": [r.to_json() for r in self.plans()],
                "arrivals": [list(a) for a in self.arrival_times.copy()]}

    def take_arrived(self) -> list[str]:
        """The requests taken in since the last call; popleft is atomic, and
        the loop thread appends after adding a request's jobs, so each one
        taken is among the core's jobs read after this (or finished)."""
        return [self.arrived.popleft() for _ in range(len(self.arrived))]

    def count_completed(self, it: Iteration, elapsed: float, jobs: dict[str, Job],
                        cost: LinearCost | None, max_batch_size: int,
                        max_batch_tokens: int) -> bool:
        """Everything counted of a completed iteration (`elapsed`: its
        seconds from planning to completion; `jobs`: the loop's, finished
        ones still among them): False for a pass cut between layers, whose
        tokens and events are none."""
        plan, result = it.plan, it.result
        if result.interrupted:
            self.interrupted += 1
            self.interrupted_time += result.iteration_time
            return False
        if plan.chunks:
            self.count_iteration(it, elapsed, online_cadence(plan, jobs, cost))
            self.measure_speed(plan, elapsed, max_batch_size, max_batch_tokens, cost)
        trace = it.trace()
        if trace is not None:
            self.add_plan(trace)
        self.count_preempted(jobs.get(j) for j in plan.preempted)
        self.count_outputs(plan, it.events, jobs)
        return True

    def count_iteration(self, it: Iteration, elapsed: float,
                        online: tuple[bool, bool, float] = (True, True, 1.0)) -> None:
        """An iteration that computed: its times, shape and the cadence of
        online tokens (`online`: `scheduler.autoscale.online_cadence`);
        `elapsed`: its seconds from planning to completion."""
        plan, spent = it.plan, it.result.iteration_time
        decodes, held, share = online
        if decodes:
            now = time.monotonic()
            if self.last_decode_end is not None:
                self.decode_gaps.append((now, share * (now - self.last_decode_end)))
            self.last_decode_end = now
        elif not held:  # no online job: the next one starts a new cadence
            self.last_decode_end = None
        self.iterations += 1
        self.forward_time += spent
        self.plan_time += it.plan_s
        self.complete_time += it.complete_s
        self.recent_forward.append(spent)
        chunks = plan.chunks
        self.recent_iterations.append((tuple([c.start_pos for c in chunks]),
                                       tuple([len(c.token_ids) for c in chunks]), spent, elapsed))

    def iteration_log(self) -> list[tuple[tuple[tuple[int, int], ...], float, float]]:
        """The latest iterations: ((start_pos, num_tokens) of each chunk,
        forward seconds, seconds from planning to completion)."""
        return [(tuple(zip(starts, lengths)), spent, elapsed)
                for starts, lengths, spent, elapsed in self.recent_iterations.copy()]

    def add_plan(self, trace: StepTrace) -> None:
        self.recent_plans.append(trace.row())

    def plans(self) -> list[StepTrace]:
        """The recorded plans, oldest first."""
        return [StepTrace(*row) for row in self.recent_plans.copy()]

    def count_preempted(self, jobs: Iterable[Job | None]) -> None:
        by_class = self.preemptions_by_class
        for job in jobs:
            if job is not None:
                by_class[job.job_class.value] = by_class.get(job.job_class.value, 0) + 1

    def count_outputs(self, plan: Plan, events: list[JobEvent], jobs: dict[str, Job]) -> None:
        """The tokens a completed plan yielded, and its drafts."""
        self.drafted += sum(c.draft for c in plan.chunks)
        for ev in events:
            if ev.token_id is None:
                continue
            n = 1 + len(ev.accepted or ())
            self.accepted += n - 1
            self.tokens_out += n
            job = jobs.get(ev.job_id)
            if job is not None:
                self.count_token(job, n)

    def count_token(self, job: Job, n: int = 1) -> None:
        """`n` tokens `job` yielded in one step (more than one with accepted
        drafts): by class, and an offline job's first."""
        cls = job.job_class.value
        self.tokens_by_class[cls] = self.tokens_by_class.get(cls, 0) + n
        if job.job_class is _OFFLINE and job.num_output_tokens == n:
            self.offline_started += 1

    def idle(self) -> None:
        """The loop ran out of work: the next decode starts a new cadence."""
        self.last_decode_end = None

    def measure_speed(self, plan: Plan, elapsed: float, max_batch_size: int,
                      max_batch_tokens: int, cost: LinearCost | None) -> None:
        """How much slower than `cost` prompt iterations run, and the
        tokens/s of (nearly) full ones."""
        if cost is not None and elapsed > 0:
            decodes = sum(1 for c in plan.chunks if c.is_decode)
            prompt = plan.num_tokens - decodes
            if prompt:
                ratio = elapsed / cost.batch_time(decodes, 0, prompt, 0)
                self.prefill_slowdown += 0.1 * (ratio - self.prefill_slowdown)
        full = (len(plan.chunks) >= 0.75 * max_batch_size
                or plan.num_tokens >= 0.75 * max_batch_tokens)
        if not full or elapsed <= 0:
            return
        sample = plan.num_tokens / elapsed
        prev = self.full_batch_tokens_per_s
        self.full_batch_tokens_per_s = sample if prev is None else prev + 0.1 * (sample - prev)
