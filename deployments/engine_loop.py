"""The iteration loop of one engine replica, on a thread of its own.

Forward passes block for milliseconds to seconds, so they run off the
replica's asyncio loop; requests and aborts reach the loop through a
thread-safe inbox and are applied between iterations, and the tokens of an
iteration leave in one batch (docs/structures.md, "Inside an engine
replica").  With a runner that offers it (`on_launch`), an iteration's batch
leaves, its text decoded, while the next iteration's pass runs: on a GPU
between queuing that pass and reading its tokens, where the host would
only wait; on a CPU just before the pass.  Each iteration is one step of
`scheduler.iteration.IterationDriver`, the simulator's step too, with the
runner on the wall clock (`OnWallClock`: waiting on a swap-in sleeps a
millisecond), or, with `ahead` (`async_scheduling`, by default on cuda), of
`scheduler.ahead.AheadDriver`, which plans an iteration while the previous
pass is in flight; the simulator does not run that one.  No Ray here: the
loop is tested with a fake runner.

`shutdown(reason)` ends the loop for good: every job in flight, and every
request submitted from then on, ends at once with an error delivery that
carries the reason (`Delivery.stopped`), so no client's stream is left
waiting on a replica that is going away.  The same happens, with a generic
reason, if the loop thread dies of an unexpected error.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Protocol

from api.protocol import GenerateRequest, JobMetrics
from deployments.delivery import Delivery
from deployments.held_deliveries import HeldDeliveries
from deployments.job_metrics import finished_record, job_metrics
from deployments.loop_stats import LoopStats
from deployments.pass_cut import PassCutter
from engine.gc_heap import YoungCollections
from scheduler.admission import MeanOutput
from scheduler.ahead import AheadDriver, OnWallClockAhead
from scheduler.cost import LinearCost
from scheduler.cost_fit import IterationShape, LiveCost
from scheduler.core import JobEvent, SchedulerCore
from scheduler.iteration import Iteration, IterationDriver, IterationFailed, OnWallClock
from scheduler.job import Job, JobClass
from scheduler.offline_pool import movable_offline
from scheduler.plan import Plan, StepResult

log = logging.getLogger(__name__)


class Runner(Protocol):
    def add_request(self, job_id: str, params: object, prompt_token_ids: list[int]) -> None: ...
    def remove_request(self, job_id: str) -> None: ...
    def execute(self, plan: Plan) -> StepResult: ...


Deliver = Callable[[list[Delivery]], None]
# Sampling parameters of choice `index` of a request.
MakeParams = Callable[[GenerateRequest, int], object]


def choice_job_ids(request_id: str, n: int) -> list[str]:
    """Job ids of a request's `n` choices; the first is the request's own."""
    return [request_id] + [f"{request_id}#{i}" for i in range(1, n)]


class EngineLoop:
    def __init__(
        self,
        runner: Runner,
        core: SchedulerCore,
        make_params: MakeParams,
        deliver: Deliver,
        cost: LinearCost | None = None,
        live_cost: LiveCost | None = None,
        ahead: bool = False,
    ) -> None:
        self.runner = runner
        self.cost = cost
        # The policy's estimate that learns from each iteration's time.
        self.live_cost = live_cost
        self.core = core
        # `ahead`: plan and launch each iteration while the previous one's
        # pass is in flight (scheduler/ahead.py; the runner must offer
        # launch / collect).
        self.driver = (AheadDriver(core, OnWallClockAhead(runner)) if ahead
                       else IterationDriver(core, OnWallClock(runner)))
        self.ahead = ahead
        self.make_params = make_params
        self.deliver = deliver
        # The latest iteration's deliveries, sent during the next pass (the
        # runner's `on_launch`) or before the loop idles.
        self.held = HeldDeliveries(deliver)
        if hasattr(runner, "on_launch"):
            runner.on_launch = self.held.flush  # type: ignore[attr-defined]
            runner.defer_text = True  # type: ignore[attr-defined]
        self.stats = LoopStats()
        self.young = YoungCollections()
        # Output lengths of finished jobs: the expected answer of a job whose
        # length is unknown (admission control).
        self.mean_output = MeanOutput(initial=min(256.0, core.config.max_model_len / 4))
        self._jobs: dict[str, Job] = {}
        # Request id -> job ids of its choices still in the core.
        self._groups: dict[str, list[str]] = {}
        # Offline requests it may give back (`give_back`): added before
        # their "add", discarded on the loop thread with their group; started
        # ones too, with at most this many device blocks to recompute.
        self._movable: set[str] = set()
        self.move_recompute_blocks: int | None = None
        self.num_given_back = 0  # requests given back
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        # Offline requests in the inbox: request id -> (jobs, prompt + n *
        # max_tokens).  The cluster's offline pool counts them as this
        # replica's queued work from the moment `submit` accepts them
        # (scheduler/offline_pool.py), not only once the loop has drained
        # them, which waits for the forward pass under way.  Distinct keys
        # are set on the asyncio thread and popped on the loop thread.
        self.inbox_offline: dict[str, tuple[int, int]] = {}
        self._wake = threading.Event()
        # Set once, by shutdown() or by the loop thread dying: the reason
        # every job ends with from then on.  Guarded by _lock so that no
        # request slips into the inbox after the last drain.
        self._lock = threading.Lock()
        # Online arrivals may cut a pure-offline pass (ConServe §4.3).
        self.cutter = PassCutter(runner, core)
        self._closed: str | None = None
        self._closed_out = threading.Event()
        self.num_stopped_jobs = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def closed(self) -> str | None:
        """The shutdown reason, or None while the loop serves."""
        return self._closed

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, reason: str, timeout: float = 30.0) -> int:
        """End every job in flight with an error delivery carrying `reason`
        and stop the loop thread; later submissions are refused the same
        way.  Idempotent and thread-safe.  Returns the number of jobs ended.

        The loop thread finishes the iteration it is in (a forward pass is
        not interruptible), then ends the jobs; this waits up to `timeout`
        seconds for that."""
        with self._lock:
            if self._closed is None:
                self._closed = reason
        self._wake.set()
        if self._thread.is_alive():
            if self._thread is not threading.current_thread():
                self._thread.join(timeout)
                if self._thread.is_alive():
                    log.warning("engine loop still in an iteration after %.0f s; its jobs "
                                "end when it returns", timeout)
        elif not self._closed_out.is_set():
            # Never started, or already gone: nobody else will end the jobs.
            self._close_out()
        return self.num_stopped_jobs

    def stop(self) -> None:
        """Stop the loop (tests, replica teardown); see `shutdown`."""
        self.shutdown("the engine replica stopped", timeout=10)

    # Thread-safe entry points -----------------------------------------

    def submit(self, req: GenerateRequest, movable: bool = False) -> None:
        with self._lock:
            reason = self._closed
            if reason is None:
                if req.job_class == JobClass.OFFLINE.value:
                    # Before the put: the loop thread pops it on draining.
                    self.inbox_offline[req.request_id] = (
                        req.n, len(req.prompt_token_ids) + req.n * req.max_tokens)
                    if movable:
                        self._movable.add(req.request_id)
                self._inbox.put(("add", req))
                self._wake.set()
                if req.job_class == JobClass.ONLINE.value:
                    self.cutter.online_arrived(len(req.prompt_token_ids) * max(1, req.n))
                return
        self._deliver_safely(self._refusals(req, reason))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def give_back(self, count: int) -> None:
        """Give up to `count` offline requests back to the pool."""
        self._inbox.put(("give_back", count))
        self._wake.set()

    def set_prediction(self, request_id: str, predicted_len: int,
                       allocation: int | None = None) -> None:
        self._inbox.put(("predict", (request_id, predicted_len, allocation)))
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
                rejected += self._add(payload)
                self.stats.arrived.append(payload.admission_id or payload.request_id)
                # After the add: in between, a snapshot would see it nowhere.
                self.inbox_offline.pop(payload.request_id, None)
            elif kind == "predict":
                rid, n, alloc = payload  # type: ignore[misc]
                # Every choice of the request answers the same prompt.
                for job_id in self._groups.get(rid, [rid]):
                    job = self.core.jobs.get(job_id)
                    # It may have finished already, or the engine's length
                    # head may have estimated it from the model's own state.
                    if job is not None and not job.length_from_engine:
                        self.core.set_prediction(job, n, alloc)
            elif kind == "give_back":
                assert isinstance(payload, int)
                rejected += self._give_back(payload)
            else:
                assert isinstance(payload, str)
                self._movable.discard(payload)
                for job_id in self._groups.pop(payload, [payload]):
                    self._drop(job_id, count=True)

    def _give_back(self, count: int) -> list[Delivery]:
        """Drop up to `count` offline requests that can go on elsewhere
        (`movable_offline`); their streams end `moved`."""
        out: list[Delivery] = []
        groups = {rid: ids for rid, ids in self._groups.items() if rid in self._movable}
        core = self.core
        for rid in movable_offline(groups, core.jobs, core.batch, count,
                                   self.move_recompute_blocks):
            self._movable.discard(rid)
            for job_id in self._groups.pop(rid):  # a started one's copy stays for its next replica
                self._drop(job_id, keep_host=bool(core.jobs[job_id].output_token_ids))
            out.append(Delivery(JobEvent(rid, None, "", True, "moved"), None,
                                "given back to the offline pool", moved=True))
        self.num_given_back += len(out)
        return out

    def _drop(self, job_id: str, keep_host: bool = False, count: bool = False) -> None:
        """`count`: the client went away, a finished job for the dashboard."""
        job = self._jobs.pop(job_id, None)
        if self.core.abort(job_id, keep_host):
            self.runner.remove_request(job_id)
            if count and job is not None:
                self.stats.finished.append(finished_record(job))

    def _add(self, req: GenerateRequest) -> list[Delivery]:
        """Add the request's `n` choices as jobs; the first prefills the
        prompt and the others share its KV blocks (scheduler/core.py), unless
        each must compute the prompt itself for its prompt logprobs."""
        ids = choice_job_ids(req.request_id, req.n)
        resume = req.resume
        # Resumed choices have outputs of their own: each computes its KV.
        share = req.prompt_logprobs is None and resume is None
        try:
            for i, job_id in enumerate(ids):
                outputs = None if resume is None else resume[i]
                if resume is not None and outputs is None:
                    continue  # this choice finished on the failed replica
                job = Job(
                    job_id=job_id,
                    prompt_token_ids=list(req.prompt_token_ids),
                    max_tokens=req.max_tokens,
                    arrival_time=req.arrival_time,
                    job_class=JobClass(req.job_class),
                    priority=req.priority,
                    cache_salt=req.cache_salt,
                    prediction=req.prediction_token_ids,
                )
                if outputs is not None:
                    self.stats.resumed_jobs += 1
                    self.stats.resumed_tokens += len(req.prompt_token_ids) + len(outputs)
                if outputs:
                    # As a job preempted mid-generation: its KV is recomputed
                    # over prompt and outputs, then it samples output
                    # len(outputs) (seeded streams count on from there).
                    job.output_token_ids = list(outputs)
                if req.jct_slo_s is not None:
                    # On the core's clock (`arrival_time` is the client's),
                    # from when the replica got it.
                    job.deadline = self.core.clock() + req.jct_slo_s
                if i > 0 and share:
                    self.core.add(job, share_prompt_with=ids[0])
                else:
                    held = req.resume_kv_blocks[i] if req.resume_kv_blocks else 0
                    # Prompt logprobs need every prompt position computed
                    # here, unless they came with the first token already.
                    self.core.add(job, host_blocks=held,
                                  use_prefix_cache=req.prompt_logprobs is None or bool(outputs))
                    if job.num_checkpointed_blocks:
                        self.stats.resumed_kv_tokens += job.num_computed_tokens
                self._jobs[job_id] = job
                params = self.make_params(req, i)
                if outputs and req.prompt_logprobs is not None:
                    # Its prompt logprobs came with its first token already.
                    params = params.model_copy(update={"prompt_logprobs": None})
                self.runner.add_request(job_id, params, job.prompt_token_ids,
                                        output_token_ids=outputs)
                job.speculate = bool(self.core.config.speculative.num_tokens
                                     and getattr(params, "draftable", False))
        except Exception as e:  # a bad request must not take the loop down
            log.warning("rejected %s: %s", req.request_id, e)
            self._movable.discard(req.request_id)
            for job_id in ids:
                self._drop(job_id)
            return [Delivery(JobEvent(j, None, "", True, "error"), None, str(e)) for j in ids]
        self._groups[req.request_id] = ids
        return []

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:  # any escape would leave every stream hanging
            log.exception("engine loop failed; ending its jobs")
            with self._lock:
                if self._closed is None:
                    self._closed = "internal error in the engine"
        finally:
            self._close_out()

    def _serve(self) -> None:
        while self._closed is None:
            if not self._busy() and self._inbox.empty():
                self.held.flush()
                self.held.raise_error()
                self.stats.idle()
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            self._wake.clear()
            t0 = time.perf_counter()
            rejected = self._drain_inbox()
            if rejected:
                self.held.send(rejected)
            if self._busy():
                done = self._iterate()
                self.held.flush()  # if the runner did not (no pass, a failure)
                self.held.hold(done)
                if self.ahead:
                    # The next pass is already running: deliver now.
                    self.held.flush()
                self.young.tick()
            self.held.raise_error()
            self.stats.loop_time += time.perf_counter() - t0

    def _refusals(self, req: GenerateRequest, reason: str) -> list[Delivery]:
        return [Delivery(JobEvent(j, None, "", True, "error"), None, reason, stopped=True)
                for j in choice_job_ids(req.request_id, req.n)]

    def _deliver_safely(self, items: list[Delivery]) -> None:
        if not items:
            return
        try:
            self.deliver(items)
        except Exception:  # the receiving side is itself going away
            log.exception("could not deliver %d shutdown errors", len(items))

    def _close_out(self) -> None:
        """End everything with the shutdown reason: the requests still in
        the inbox, then every job in flight, then free their host copies.
        Runs once, on the loop thread (or on the caller's if the thread
        never ran)."""
        if self._closed_out.is_set():
            return
        self._closed_out.set()
        reason = self._closed or "the engine replica stopped"
        # Tokens computed before the end go out before the errors.
        self.held.flush()
        try:
            self._deliver_safely(self._iterate(drain=True))
        except Exception:  # the jobs end with the reason below anyway
            log.exception("settling the pass in flight at shutdown failed")
        out: list[Delivery] = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                assert isinstance(payload, GenerateRequest)
                self.inbox_offline.pop(payload.request_id, None)
                out += self._refusals(payload, reason)
            elif kind == "abort":
                assert isinstance(payload, str)
                for job_id in self._groups.pop(payload, [payload]):
                    self._drop(job_id, count=True)
        ended = list(self._jobs) + [j for j in list(self.core.jobs) if j not in self._jobs]
        for job_id in ended:
            try:
                self._drop(job_id)
            except Exception:  # keep ending the others
                log.exception("aborting %s at shutdown failed", job_id)
            out.append(Delivery(JobEvent(job_id, None, "", True, "error"), None, reason,
                                stopped=True))
        self._groups.clear()
        self._movable.clear()
        self.num_stopped_jobs = len(ended)
        self._deliver_safely(out)
        # The aborted jobs' host copies are dropped by block ops, which ride
        # on plans; a few chunkless iterations carry them out.
        try:
            for _ in range(4):
                if not self.core.swap.pending_ops:
                    break
                self._iterate()
        except Exception:  # the directory goes with the application anyway
            log.warning("dropping host KV copies at shutdown failed", exc_info=True)

    def _busy(self) -> bool:
        # Drops of finished jobs' host copies also need a plan to ride on.
        return (self.core.has_work or bool(self.core.swap.pending_ops)
                or self.driver.in_flight is not None)

    def _iterate(self, drain: bool = False) -> list[Delivery]:
        """One step of the driver (with `drain`, or when only a pass in
        flight is left, settling it), and the deliveries of the iterations
        it completed."""
        t0 = time.perf_counter()
        try:
            if drain or not (self.core.has_work or self.core.swap.pending_ops):
                its = self.driver.drain()
            else:
                its = self.driver.steps()
        except IterationFailed as e:
            log.exception("iteration %d failed; aborting its jobs", e.plan.step)
            return [self._fail(c.job_id) for c in e.plan.chunks if c.job_id in self._jobs]
        # Planning to completion, finished jobs' runner state dropped.
        elapsed = (time.perf_counter() - t0) / max(1, len(its))
        out: list[Delivery] = []
        for it in its:
            out += self._account(it, elapsed)
        return out

    def _account(self, it: Iteration, elapsed: float) -> list[Delivery]:
        """Stats and deliveries of one completed iteration."""
        cfg = self.core.config
        if not self.stats.count_completed(it, elapsed, self._jobs, self.cost,
                                          cfg.max_batch_size, cfg.max_batch_tokens):
            return []
        plan = it.plan
        if plan.chunks and self.live_cost is not None:
            # The whole iteration, planning included: what separates an
            # online job's tokens (its TPOT).
            self.live_cost.observe(
                IterationShape.of((c.start_pos, c.num_tokens) for c in plan.chunks), elapsed)
        out: list[Delivery] = []
        for ev in it.events:
            metrics = None
            if ev.finished:  # the driver dropped it from the runner
                metrics = self._metrics(ev.job_id)
                self._forget(ev.job_id)
            out.append(Delivery(ev, metrics))
        return out

    def _forget(self, job_id: str) -> None:
        """A finished choice leaves its request's group."""
        rid = job_id.split("#", 1)[0]
        group = self._groups.get(rid)
        if group is not None and job_id in group:
            group.remove(job_id)
            if not group:
                del self._groups[rid]
                self._movable.discard(rid)

    def _fail(self, job_id: str) -> Delivery:
        self._jobs.pop(job_id, None)
        self.core.abort(job_id)
        self.runner.remove_request(job_id)
        self._forget(job_id)
        return Delivery(JobEvent(job_id, None, "", True, "error"), None,
                        "internal error in the engine", internal=True)

    def _metrics(self, job_id: str) -> JobMetrics | None:
        job = self._jobs.pop(job_id, None)
        if job is None:
            return None
        self.mean_output.add(job.num_output_tokens)
        self.stats.finished.append(finished_record(job))
        return job_metrics(job)
