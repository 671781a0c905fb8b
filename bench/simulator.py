"""The simulator: the very same scheduler code on a virtual clock.

Time is injected (docs/structures.md, "Packages"): this simulator steps
`scheduler.core.SchedulerCore`, with a policy from `scheduler/policies/`,
through `scheduler.iteration.IterationDriver`, as the server's engine loop
does without `async_scheduling`.  With it (by default on cuda) the loop
runs `scheduler.ahead.AheadDriver`, which plans each iteration while the
previous pass is in flight; the simulator does not.  Here the clock is
virtual and each iteration lasts what a cost model (bench/costmodel.py)
says -- the analytic OPT/A100 model for paper-scale results, or the table
fitted by the profiler to our engine.

The loop, per iteration:
  1. admit every request whose arrival time is <= now;
  2. one step of the server's iteration driver (scheduler/iteration.py):
     plan = core.schedule(), run it on `SimulatedExecutor`
     (bench/sim_executor.py: the cost model and the swap lanes, reactive or
     overlapped, which advance the clock by the iteration's time and report
     landed swap-ins), core.complete(); one token (an arbitrary id) is
     sampled per chunk that samples, and the core finishes a job when it
     reaches its max_tokens, which is the request's output length
     (ignore_eos), unless the request sets a larger cap (`RequestSpec.
     max_tokens`): the executor then samples end-of-sequence at the
     output length.  A plan that computes nothing while jobs remain takes
     the driver's swap-wait rule: the clock jumps to the next swap-in
     landing (or arrival);
  3. when nothing is runnable, jump to the next arrival.

Each job's E2E latency splits into execution and swapping, as the executor
accounts them, and queueing (the rest: waiting for admission and time spent
preempted) -- FastServe Figures 1 and 15b.

Output: the same `RequestRecord`s a live run produces, so metrics and plots
are computed by the same code.
"""

from __future__ import annotations

import itertools

import bisect
import heapq

import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

from bench.costmodel import BatchShape, CostModel
from bench.records import RequestRecord
from bench.sim_executor import DeviceTotals, SimulatedExecutor, VirtualClock
from bench.workload import RequestSpec
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.iteration import IterationDriver
from scheduler.job import Job, JobClass, padded_length
from scheduler.plan import BlockOpKind
from scheduler.trace import StepTrace


class SimulationError(RuntimeError):
    pass


class SLOAbort(SimulationError):
    """The run was stopped early: a lower bound of its mean normalized
    latency already exceeds `SimOptions.abort_mean_normalized_latency`, so it
    cannot meet that SLO (saves the time of simulating a collapse)."""

    def __init__(self, bound: float, at: float, finished: int, total: int) -> None:
        super().__init__(
            f"mean normalized latency >= {bound:.4f} s/token at t={at:.1f}s "
            f"({finished}/{total} finished): the SLO cannot be met"
        )
        self.bound = bound
        self.at = at
        self.finished = finished
        self.total = total


class CostEstimatorAdapter:
    """A cost model seen through `scheduler.cost.CostEstimator`, the view a
    policy gets (MLFQ quanta and skip-join, FastServe §4.1)."""

    def __init__(self, cost: CostModel, decode_context: int = 256) -> None:
        self.cost = cost
        self.decode_context = decode_context

    def prefill_time(self, num_tokens: int) -> float:
        n = max(num_tokens, 1)
        return self.cost.iteration_time(
            BatchShape(prefill_tokens=n, prefill_chunks=1, prefill_attn=n * (n + 1) // 2,
                       prefill_kv=n, num_sampled=1)
            if n > 1
            else BatchShape(decode_tokens=1, decode_context=1, num_sampled=1)
        )

    def decode_time(self, batch_size: int) -> float:
        b = max(batch_size, 1)
        return self.cost.iteration_time(
            BatchShape(decode_tokens=b, decode_context=b * self.decode_context, num_sampled=b)
        )

    def batch_time(self, decodes: int, decode_context: int, prefill_tokens: int,
                   prefill_attn: int) -> float:
        # A prefill chunk reads about its own tokens' KV (its context is
        # counted in `prefill_attn`); one sampled row per decode and chunk.
        return self.cost.iteration_time(BatchShape(
            prefill_tokens=prefill_tokens, prefill_chunks=1 if prefill_tokens else 0,
            prefill_attn=prefill_attn, prefill_kv=prefill_tokens, decode_tokens=decodes,
            decode_context=decode_context, num_sampled=decodes + (1 if prefill_tokens else 0)))


def make_core(config: SchedulerConfig, clock: VirtualClock, cost: CostModel) -> SchedulerCore:
    """The scheduler core, handed the cost model when it takes one."""
    if "cost" in inspect.signature(SchedulerCore.__init__).parameters:
        return SchedulerCore(config, clock, cost=CostEstimatorAdapter(cost))  # type: ignore[call-arg]
    return SchedulerCore(config, clock)


class SimOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    overlap_swap: bool = False
    # Safety bound on the loop (None: unbounded).
    max_iterations: int | None = None
    # Stop admitting new requests after this virtual time (None: all).
    max_time: float | None = None
    # Raise `SLOAbort` as soon as a lower bound of the mean normalized
    # latency over all requests exceeds this (finished jobs count exactly,
    # unfinished ones as (now - arrival) / output tokens, requests not yet
    # arrived as 0).  None: never.
    abort_mean_normalized_latency: float | None = None
    # Keep every plan that did something as a `scheduler.trace.StepTrace`
    # (SimOutput.trace), as the live engine loop does.
    trace: bool = False
    # The predictor's padding (EconoServe §2.3) on replayed predictions:
    # `Job.allocated_output_len` = ceil(prediction * (1 + ratio)).
    padding_ratio: float = Field(0.15, ge=0.0)
    # Every replayed prediction lands this many seconds after its job
    # arrives, in place of each request's own `prediction_delay_s`.
    prediction_delay_s: float | None = Field(None, ge=0.0)
    # Replayed predictions are the engine's length head's (`engine_head`):
    # each lands with its job's first sampled token, however late that
    # comes, padded by the scheduler's `length_padding_ratio` as live.
    predictions_at_first_token: bool = False


@dataclass
class SimStats:
    iterations: int = 0
    busy_time: float = 0.0  # Σ iteration times
    wall_time: float = 0.0  # real seconds the simulation took
    num_preemptions: int = 0
    swap_blocks: int = 0
    swap_in_blocks: int = 0
    swap_out_blocks: int = 0
    swap_bytes: int | None = 0
    # Copy time that lengthened iterations (on the critical path).
    exposed_swap_time: float = 0.0
    # Busy time of the host -> device lane (overlap mode).
    swap_in_lane_busy: float = 0.0
    sum_batch_size: int = 0
    sum_batch_tokens: int = 0
    # Σ over iterations of the share of device KV blocks in use.
    sum_kv_utilization: float = 0.0
    # Passes cut between layers for an online arrival (ConServe §4.3) and
    # the compute they threw away.
    cut_passes: int = 0
    cut_time: float = 0.0
    # Incremental checkpointing (ConServe §4.4): blocks copied, the busy
    # time of their lane, preemptions that discarded to a checkpoint and
    # the computed tokens those gave up; computed tokens dropped by
    # preemptions to recompute; resumes that found no host copy.
    checkpoint_blocks: int = 0
    checkpoint_lane_busy: float = 0.0
    checkpoint_discards: int = 0
    tokens_discarded: int = 0
    tokens_dropped: int = 0
    recompute_fallbacks: int = 0
    # Saturated throughput: requests finished while the waiting queue was
    # non-empty, over the time it last was (measures capacity, rate = inf).
    last_backlog_time: float = 0.0
    finished_at_last_backlog: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def take(self, device: DeviceTotals) -> None:
        """The simulated device's sums over the run."""
        self.busy_time = device.busy_time
        self.exposed_swap_time = device.exposed_swap_time
        self.swap_in_lane_busy = device.swap_in_lane_busy
        self.swap_in_blocks = device.swap_in_blocks
        self.swap_out_blocks = device.swap_out_blocks
        self.swap_blocks = device.swap_in_blocks + device.swap_out_blocks
        self.cut_passes = device.cut_passes
        self.cut_time = device.cut_time
        self.checkpoint_blocks = device.checkpoint_blocks
        self.checkpoint_lane_busy = device.checkpoint_lane_busy

    @property
    def saturated_throughput(self) -> float | None:
        if self.last_backlog_time <= 0 or self.finished_at_last_backlog == 0:
            return None
        return self.finished_at_last_backlog / self.last_backlog_time

    def as_dict(self) -> dict[str, Any]:
        it = max(self.iterations, 1)
        return {
            "iterations": self.iterations,
            "busy_time": self.busy_time,
            "wall_time": self.wall_time,
            "num_preemptions": self.num_preemptions,
            "swap_blocks": self.swap_blocks,
            "swap_in_blocks": self.swap_in_blocks,
            "swap_out_blocks": self.swap_out_blocks,
            "swap_bytes": self.swap_bytes,
            "exposed_swap_time": self.exposed_swap_time,
            "swap_in_lane_busy": self.swap_in_lane_busy,
            "mean_batch_size": self.sum_batch_size / it,
            "mean_batch_tokens": self.sum_batch_tokens / it,
            "mean_kv_utilization": self.sum_kv_utilization / it,
            "saturated_throughput": self.saturated_throughput,
            "cut_passes": self.cut_passes,
            "cut_time": self.cut_time,
            "checkpoint_blocks": self.checkpoint_blocks,
            "checkpoint_lane_busy": self.checkpoint_lane_busy,
            "checkpoint_discards": self.checkpoint_discards,
            "tokens_discarded": self.tokens_discarded,
            "tokens_dropped": self.tokens_dropped,
            "recompute_fallbacks": self.recompute_fallbacks,
            **self.extra,
        }


@dataclass
class SimOutput:
    records: list[RequestRecord]
    stats: SimStats
    end_time: float
    trace: list[StepTrace] = field(default_factory=list)


def _block_bytes(cost: CostModel) -> int | None:
    """Bytes of one KV block over the whole model; None where the cost model
    does not know (a table profiled before tables recorded it)."""
    model = getattr(cost, "model", None)
    bs = getattr(cost, "block_size", None)
    if model is not None and bs is not None:
        return int(bs * model.kv_bytes_per_token)
    table = getattr(cost, "table", None)
    return getattr(table, "block_bytes", None)


def _prompt_ids(r: RequestSpec, own: int) -> list[int]:
    """Token ids standing for `r`'s prompt: its shared prefix alike in every
    request, then its own first token (`own`), so that the prefix cache
    finds what a live server's would (bench/workload.py)."""
    shared = min(r.shared_prefix_tokens, r.prompt_tokens - 1)
    return [0] * shared + [own] + [0] * (r.prompt_tokens - shared - 1)


def make_job(r: RequestSpec, own_token: int, device: SimulatedExecutor,
             padding_ratio: float, delayed: bool = False) -> Job:
    """The scheduler's job for request `r` (its prompt's own first token
    `own_token`), and the executor told where it ends when `max_tokens` is
    only a cap.  `delayed`: its prediction lands later (`SchedulerCore.set_prediction`)."""
    job = Job(
        job_id=r.request_id,
        # Its own token right after the shared prefix: prompts share cached
        # blocks within that prefix only, as the synthetic prompts a live
        # run sends do.
        prompt_token_ids=_prompt_ids(r, own_token),
        max_tokens=r.max_tokens or r.output_tokens,
        arrival_time=r.arrival_time,
        job_class=JobClass(r.job_class),
        priority=r.priority,
    )
    if r.max_tokens is not None and r.max_tokens > r.output_tokens:
        device.stop_lengths[r.request_id] = r.output_tokens
    if r.predicted_output_tokens is not None and not delayed:
        job.predicted_output_len = r.predicted_output_tokens
        job.allocated_output_len = padded_length(r.predicted_output_tokens, padding_ratio)
    return job


def request_record(r: RequestSpec, job: Job | None, token_times: list[float],
                   device: SimulatedExecutor, block_bytes: int | None, error: str | None
                   ) -> RequestRecord:
    """What a live run would have recorded of request `r` (`job`: None when
    it was never admitted, `error` says why)."""
    rid = r.request_id
    if job is None:
        return RequestRecord(
            request_id=rid, job_class=r.job_class, scheduled_time=r.arrival_time,
            send_time=r.arrival_time, prompt_tokens=r.prompt_tokens,
            expected_output_tokens=r.output_tokens, error=error or "not admitted")
    end = job.finish_time
    e2e = (end - r.arrival_time) if end is not None else math.nan
    ex, sw = device.exec_time.get(rid, 0.0), device.swap_time.get(rid, 0.0)
    # model_construct: these values are ours, skip re-validating thousands
    # of token-time lists.
    return RequestRecord.model_construct(
        request_id=rid,
        job_class=r.job_class,
        scheduled_time=r.arrival_time,
        send_time=r.arrival_time,
        token_times=token_times,
        end_time=end,
        prompt_tokens=r.prompt_tokens,
        output_tokens=job.num_output_tokens,
        expected_output_tokens=r.output_tokens,
        error=None if end is not None else "unfinished",
        num_preemptions=job.num_preemptions,
        queueing_time=max(0.0, e2e - ex - sw) if end is not None else None,
        execution_time=ex,
        swap_time=sw,
        swap_bytes=None if block_bytes is None else device.swap_blocks.get(rid, 0) * block_bytes,
        predicted_output_tokens=r.predicted_output_tokens,
        prediction_delay_s=(None if job.prediction_time is None
                            else job.prediction_time - r.arrival_time),
    )


def simulate(
    requests: Sequence[RequestSpec],
    scheduler: SchedulerConfig,
    cost: CostModel,
    options: SimOptions | None = None,
) -> SimOutput:
    opts = options or SimOptions()
    wall0 = time.perf_counter()
    clock = VirtualClock()
    core = make_core(scheduler, clock, cost)
    reqs = sorted(requests, key=lambda r: r.arrival_time)
    n = len(reqs)
    jobs: dict[str, Job] = {}
    first_tokens = itertools.count(1)
    token_times: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    block_bytes = _block_bytes(cost)
    stats = SimStats()
    i = 0
    idle_plans = 0  # consecutive plans that only drop host copies
    online = [r for r in reqs if r.job_class == "online"]
    online_times = [r.arrival_time for r in online]

    def next_online_after(t: float) -> tuple[float, int] | None:
        """The first online arrival after `t`, with the prompt tokens of
        every online request arriving then."""
        k = bisect.bisect_right(online_times, t)
        if k == len(online_times):
            return None
        at = online_times[k]
        last = bisect.bisect_right(online_times, at)
        return at, sum(r.prompt_tokens for r in online[k:last])

    device = SimulatedExecutor(cost, clock, opts.overlap_swap,
                               lambda: reqs[i].arrival_time if i < n else None,
                               next_online_after, getattr(core.policy, "cut_wanted", None))
    driver = IterationDriver(core, device)

    # Predictions still on their way: (when they land, request id, prediction).
    landing: list[tuple[float, str, int]] = []

    def admit() -> None:
        nonlocal i
        while i < n and reqs[i].arrival_time <= clock.now:
            r = reqs[i]
            i += 1
            if opts.max_time is not None and r.arrival_time > opts.max_time:
                errors[r.request_id] = "not sent: past max_time"
                continue
            delay = (opts.prediction_delay_s if opts.prediction_delay_s is not None
                     else r.prediction_delay_s) or 0.0
            head = opts.predictions_at_first_token and r.predicted_output_tokens is not None
            delayed = r.predicted_output_tokens is not None and (delay > 0 or head)
            job = make_job(r, next(first_tokens), device, opts.padding_ratio, delayed)
            try:
                core.add(job)
            except ValueError as e:
                errors[r.request_id] = f"rejected: {e}"
                continue
            jobs[r.request_id] = job
            token_times[r.request_id] = []
            if head:
                assert r.predicted_output_tokens is not None
                device.head_estimates[r.request_id] = r.predicted_output_tokens
            elif delayed:
                assert r.predicted_output_tokens is not None
                heapq.heappush(landing, (r.arrival_time + delay, r.request_id,
                                         r.predicted_output_tokens))
        # As the live engine loop applies a prediction between iterations.
        while landing and landing[0][0] <= clock.now:
            _, rid, predicted = heapq.heappop(landing)
            job = core.jobs.get(rid)
            if job is not None:
                core.set_prediction(job, predicted, padded_length(predicted, opts.padding_ratio))

    trace: list[StepTrace] = []
    abort_nl = opts.abort_mean_normalized_latency
    nl_done = 0.0  # Σ E2E / output over finished jobs
    counted: set[str] = set()

    def _check_abort(now: float) -> None:
        nonlocal nl_done
        bound = 0.0
        for jid, job in jobs.items():
            if job.finish_time is not None:
                if jid not in counted:
                    counted.add(jid)
                    nl_done += (job.finish_time - job.arrival_time) / max(job.num_output_tokens, 1)
            else:
                bound += (now - job.arrival_time) / max(job.max_tokens, 1)
        bound = (bound + nl_done) / max(n, 1)
        if bound > abort_nl:
            raise SLOAbort(bound, now, core.num_finished, n)

    while True:
        admit()
        if not core.has_work:
            if i >= n:
                break
            clock.now = max(clock.now, reqs[i].arrival_time)
            continue
        if opts.max_iterations is not None and stats.iterations >= opts.max_iterations:
            raise SimulationError(f"stopped after max_iterations={opts.max_iterations}")
        it = driver.step()
        plan = it.plan
        if opts.trace and (rec := it.trace()) is not None:
            trace.append(rec)
        if plan.is_empty:
            # The wait moved the clock to a landing or an arrival; with
            # neither to come, nothing ever will.
            if not it.result.swaps_in_done and not device.swaps_in_flight and i >= n:
                raise SimulationError(
                    f"scheduler made no progress at t={clock.now:.3f} with "
                    f"{len(core.jobs)} jobs left (KV too small for one of them?)"
                )
            continue
        if not plan.chunks and all(op.kind is BlockOpKind.DROP for op in plan.block_ops):
            idle_plans += 1
            if idle_plans > 1000:
                raise SimulationError(f"scheduler spins without work at t={it.planned_at:.3f}")
        else:
            idle_plans = 0
        if it.result.interrupted:
            continue  # the device totals keep its thrown-away time
        stats.iterations += 1
        stats.num_preemptions += len(plan.preempted)
        stats.sum_batch_size += len(plan.chunks)
        stats.sum_batch_tokens += plan.num_tokens
        stats.sum_kv_utilization += core.blocks.utilization
        now = clock.now
        for ev in it.events:
            token_times[ev.job_id].append(now)
        if it.num_waiting > 0:  # jobs left waiting by this plan: the batch ran saturated
            stats.last_backlog_time = now
            stats.finished_at_last_backlog = core.num_finished
        if abort_nl is not None and stats.iterations % 64 == 0:
            _check_abort(now)

    stats.take(device.totals)
    stats.checkpoint_discards = core.swap.num_checkpoint_discards
    stats.tokens_discarded = core.swap.tokens_discarded
    stats.tokens_dropped = core.swap.tokens_dropped
    stats.recompute_fallbacks = core.swap.num_recompute_fallbacks
    counters = getattr(core.policy, "counters", None)
    if counters is not None:
        stats.extra.update(counters())
    stats.swap_bytes = None if block_bytes is None else stats.swap_blocks * block_bytes
    stats.wall_time = time.perf_counter() - wall0
    records = [request_record(r, jobs.get(r.request_id), token_times.get(r.request_id, []),
                              device, block_bytes, errors.get(r.request_id))
               for r in reqs]
    return SimOutput(records=records, stats=stats, end_time=clock.now, trace=trace)


def measure_capacity(
    requests: Sequence[RequestSpec],
    scheduler: SchedulerConfig,
    cost: CostModel,
    options: SimOptions | None = None,
) -> float:
    """Saturated throughput (req/s): all requests arrive at t = 0.

    Counts requests finished while others were still waiting, over the time
    the backlog lasted, so the drain at the end (a few long jobs running at
    a small batch) does not dilute it.  A load ρ is then the arrival rate
    ρ · capacity (FastServe Figure 1's load).
    """
    burst = [r.model_copy(update={"arrival_time": 0.0}) for r in requests]
    out = simulate(burst, scheduler, cost, options)
    cap = out.stats.saturated_throughput
    if cap is None:
        done = sum(r.ok for r in out.records)
        cap = done / out.end_time if out.end_time > 0 else math.inf
    return cap
