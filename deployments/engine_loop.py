"""The iteration loop of one engine replica, on a thread of its own.

Forward passes block for milliseconds to seconds, so they run off the
replica's asyncio loop; requests and aborts reach the loop through a
thread-safe inbox and are applied between iterations, and the tokens of an
iteration leave in one batch (ARCHITECTURE.md: once per iteration per
replica).  No Ray here: the loop is tested with a fake runner.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from app.protocol import GenerateRequest, JobMetrics
from scheduler.core import JobEvent, SchedulerCore
from scheduler.job import Job, JobClass
from scheduler.plan import Plan, StepResult
from scheduler.trace import StepTrace

log = logging.getLogger(__name__)


class Runner(Protocol):
    def add_request(self, job_id: str, params: object, prompt_token_ids: list[int]) -> None: ...
    def remove_request(self, job_id: str) -> None: ...
    def execute(self, plan: Plan) -> StepResult: ...


@dataclass(slots=True)
class Delivery:
    event: JobEvent
    metrics: JobMetrics | None  # set on the job's last event
    error: str | None = None


@dataclass(slots=True)
class LoopStats:
    iterations: int = 0
    forward_time: float = 0.0
    # Wall time of whole iterations, inbox to delivery: the difference to
    # forward_time is the control overhead (planning, bookkeeping, delivery).
    loop_time: float = 0.0
    tokens_out: int = 0
    # Forward times of the latest iterations, for steady-state figures.
    recent_forward: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    # The latest iterations as run here: ((start_pos, num_tokens) of each
    # chunk, forward seconds, seconds from planning to completion), for a
    # cost table measured in place (`python -m bench profile-live`).
    recent_iterations: deque[tuple[tuple[tuple[int, int], ...], float, float]] = field(
        default_factory=lambda: deque(maxlen=20_000))
    # Every plan that did something, for comparing a live run with its
    # simulation step by step (`python -m bench trace-summary`).
    recent_plans: deque[StepTrace] = field(default_factory=lambda: deque(maxlen=50_000))


Deliver = Callable[[list[Delivery]], None]
MakeParams = Callable[[GenerateRequest], object]


class EngineLoop:
    def __init__(
        self,
        runner: Runner,
        core: SchedulerCore,
        make_params: MakeParams,
        deliver: Deliver,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runner = runner
        self.core = core
        self.make_params = make_params
        self.deliver = deliver
        self.clock = clock
        self.stats = LoopStats()
        self._jobs: dict[str, Job] = {}
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # Thread-safe entry points -----------------------------------------

    def submit(self, req: GenerateRequest) -> None:
        self._inbox.put(("add", req))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def set_prediction(self, request_id: str, predicted_len: int) -> None:
        self._inbox.put(("predict", (request_id, predicted_len)))
        self._wake.set()

    # Loop ---------------------------------------------------------------

    def _drain_inbox(self) -> list[Delivery]:
        rejected: list[Delivery] = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return rejected
            if kind == "add":
                assert isinstance(payload, GenerateRequest)
                err = self._add(payload)
                if err is not None:
                    rejected.append(err)
            elif kind == "predict":
                rid, n = payload  # type: ignore[misc]
                job = self.core.jobs.get(rid)
                if job is not None:  # it may have finished already
                    job.predicted_output_len = n
            else:
                assert isinstance(payload, str)
                self._jobs.pop(payload, None)
                if self.core.abort(payload):
                    self.runner.remove_request(payload)

    def _add(self, req: GenerateRequest) -> Delivery | None:
        job = Job(
            job_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            max_tokens=req.max_tokens,
            arrival_time=req.arrival_time,
            job_class=JobClass(req.job_class),
        )
        try:
            self.core.add(job)
            self.runner.add_request(job.job_id, self.make_params(req), job.prompt_token_ids)
        except Exception as e:  # a bad request must not take the loop down
            log.warning("rejected %s: %s", req.request_id, e)
            self.core.abort(job.job_id)
            return Delivery(JobEvent(job.job_id, None, "", True, "error"), None, str(e))
        self._jobs[job.job_id] = job
        return None

    def _run(self) -> None:
        while not self._stop:
            if not self._busy() and self._inbox.empty():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            self._wake.clear()
            t0 = time.perf_counter()
            deliveries = self._drain_inbox()
            if self._busy():
                deliveries += self._iterate()
            if deliveries:
                self.deliver(deliveries)
            self.stats.loop_time += time.perf_counter() - t0

    def _busy(self) -> bool:
        # Drops of finished jobs' host copies also need a plan to ride on.
        return self.core.has_work or bool(self.core.swap.pending_ops)

    def _iterate(self) -> list[Delivery]:
        t0 = time.perf_counter()
        t_plan = self.clock()
        plan = self.core.schedule()
        try:
            # A plan without chunks still carries block ops, and its result
            # reports swap-ins that landed meanwhile.
            result = self.runner.execute(plan)
        except Exception:
            log.exception("iteration %d failed; aborting its jobs", plan.step)
            return [self._fail(c.job_id) for c in plan.chunks]
        if not plan.chunks:
            # Everything runnable waits on a swap-in: let the copy land
            # instead of spinning.
            if self.core.has_work:
                time.sleep(0.001)
        else:
            self.stats.iterations += 1
            self.stats.forward_time += result.iteration_time
            self.stats.recent_forward.append(result.iteration_time)
        events = self.core.complete(plan, result)
        if StepTrace.eventful(plan, result):
            self.stats.recent_plans.append(StepTrace.of(t_plan, plan, result))
        if plan.chunks:
            self.stats.recent_iterations.append((
                tuple((c.start_pos, len(c.token_ids)) for c in plan.chunks),
                result.iteration_time, time.perf_counter() - t0))
        out: list[Delivery] = []
        for ev in events:
            self.stats.tokens_out += ev.token_id is not None
            metrics = None
            if ev.finished:
                self.runner.remove_request(ev.job_id)
                metrics = self._metrics(ev.job_id)
            out.append(Delivery(ev, metrics))
        return out

    def _fail(self, job_id: str) -> Delivery:
        self._jobs.pop(job_id, None)
        self.core.abort(job_id)
        self.runner.remove_request(job_id)
        return Delivery(
            JobEvent(job_id, None, "", True, "error"), None, "internal error in the engine"
        )

    def _metrics(self, job_id: str) -> JobMetrics | None:
        job = self._jobs.pop(job_id, None)
        if job is None:
            return None
        arrival = job.arrival_time
        return JobMetrics(
            queue_time=(job.first_scheduled_time or arrival) - arrival,
            ttft=(job.first_token_time or arrival) - arrival,
            e2e=(job.finish_time or arrival) - arrival,
            execution_time=job.attained_service,
            swap_wait_time=job.swap_wait_time,
            num_preemptions=job.num_preemptions,
            predicted_output_len=job.predicted_output_len,
        )
