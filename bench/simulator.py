"""The simulator: the very same scheduler code on a virtual clock.

ARCHITECTURE.md, "Time is injected": the server's engine driver and this
simulator both run `scheduler.core.SchedulerCore` with a policy from
`scheduler/policies/`; here the clock is virtual and each iteration lasts
what a cost model (bench/costmodel.py) says -- the analytic OPT/A100 model
for paper-scale results, or the table fitted by the profiler to our engine.

The loop, per iteration:
  1. admit every request whose arrival time is <= now;
  2. plan = core.schedule();
  3. iteration time = cost(plan's batch shape) + the swap time of its block
     copies, modelled two ways (PCIe 4.0 x16, `cost.swap_time`):
       * default (reactive swapping, FastServe Fig. 9a): every copy of the
         plan, out and in, runs on the critical path before the forward
         pass: the iteration lasts compute + copy time, and the plan's
         swap-ins have landed when it ends;
       * `overlap_swap` (proactive swapping, FastServe §4.2 / Fig. 9b): the
         copies run on side streams, one per PCIe direction.  Swap-outs
         (device -> host) overlap the forward pass, but the iteration cannot
         end before they are done (their blocks were freed for reuse), so
         only the part longer than the compute is exposed.  Swap-ins
         (host -> device) queue on their own lane and land after their copy
         time, possibly iterations later, without stalling the batch; the
         scheduler learns of them through `StepResult.swaps_in_done` at the
         first iteration boundary after they land.  If nothing is runnable
         meanwhile the clock jumps to the next landing (or arrival);
  4. advance the clock, sample one token (an arbitrary id) per chunk that
     samples, core.complete(); the core finishes a job when it reaches its
     max_tokens, which is the request's output length (ignore_eos);
  5. when nothing is runnable, jump to the next arrival (or swap-in landing).

Each job's E2E latency splits into execution (compute time of the
iterations it was part of), swapping (the exposed copy time of those
iterations, plus the time from the issue of its own swap-in to the
iteration boundary that reports it landed: "blocked by the swapping
mechanism", an upper bound since the job might not have been scheduled
earlier anyway) and queueing (the rest: waiting for admission and time spent
preempted) -- FastServe Figures 1 and 15b.

Output: the same `RequestRecord`s a live run produces, so metrics and plots
are computed by the same code.
"""

from __future__ import annotations

import heapq
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict

from bench.costmodel import BatchShape, CostModel
from bench.records import RequestRecord
from bench.workload import RequestSpec
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.job import Job, JobClass
from scheduler.plan import BlockOpKind, JobOutput, StepResult
from scheduler.trace import StepTrace

SAMPLED_TOKEN_ID = 1


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


class VirtualClock:
    """The injected clock: a callable returning simulated seconds."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


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


@dataclass
class SimStats:
    iterations: int = 0
    busy_time: float = 0.0  # Σ iteration times
    wall_time: float = 0.0  # real seconds the simulation took
    num_preemptions: int = 0
    swap_blocks: int = 0
    swap_in_blocks: int = 0
    swap_out_blocks: int = 0
    swap_bytes: int = 0
    # Copy time that lengthened iterations (on the critical path).
    exposed_swap_time: float = 0.0
    # Busy time of the host -> device lane (overlap mode).
    swap_in_lane_busy: float = 0.0
    sum_batch_size: int = 0
    sum_batch_tokens: int = 0
    # Saturated throughput: requests finished while the waiting queue was
    # non-empty, over the time it last was (measures capacity, rate = inf).
    last_backlog_time: float = 0.0
    finished_at_last_backlog: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

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
            "saturated_throughput": self.saturated_throughput,
            **self.extra,
        }


@dataclass
class SimOutput:
    records: list[RequestRecord]
    stats: SimStats
    end_time: float
    trace: list[StepTrace] = field(default_factory=list)


def _block_bytes(cost: CostModel) -> int:
    """Bytes of one KV block over the whole model, if the cost model knows."""
    model = getattr(cost, "model", None)
    bs = getattr(cost, "block_size", None)
    if model is not None and bs is not None:
        return int(bs * model.kv_bytes_per_token)
    table = getattr(cost, "table", None)
    return int(getattr(table, "block_bytes", 0) or 0)


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
    token_times: dict[str, list[float]] = {}
    exec_time: dict[str, float] = {}
    swap_time: dict[str, float] = {}
    swap_blocks: dict[str, int] = {}
    errors: dict[str, str] = {}
    block_bytes = _block_bytes(cost)
    stats = SimStats()
    policy = core.policy
    i = 0
    idle_plans = 0  # consecutive plans that only drop host copies

    def admit() -> None:
        nonlocal i
        while i < n and reqs[i].arrival_time <= clock.now:
            r = reqs[i]
            i += 1
            if opts.max_time is not None and r.arrival_time > opts.max_time:
                errors[r.request_id] = "not sent: past max_time"
                continue
            job = Job(
                job_id=r.request_id,
                prompt_token_ids=[0] * r.prompt_tokens,
                max_tokens=r.output_tokens,
                arrival_time=r.arrival_time,
                job_class=JobClass(r.job_class),
            )
            try:
                core.add(job)
            except ValueError as e:
                errors[r.request_id] = f"rejected: {e}"
                continue
            jobs[r.request_id] = job
            token_times[r.request_id] = []
            exec_time[r.request_id] = 0.0
            swap_time[r.request_id] = 0.0

    # Swap-ins in flight (overlap mode): (landing time, seq, job id).
    trace: list[StepTrace] = []
    in_flight: list[tuple[float, int, str]] = []
    issued_at: dict[str, float] = {}
    in_lane_free = 0.0  # host -> device copy lane
    seq = 0

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

    def landed_by(t: float) -> list[str]:
        done: list[str] = []
        while in_flight and in_flight[0][0] <= t + 1e-12:
            _, _, jid = heapq.heappop(in_flight)
            done.append(jid)
            t0 = issued_at.pop(jid, None)
            if t0 is not None and jid in swap_time:
                # Blocked on its own swap-in from issue to the report.
                swap_time[jid] += clock.now - t0
        return done

    while True:
        admit()
        if not core.has_work:
            if i >= n:
                break
            clock.now = max(clock.now, reqs[i].arrival_time)
            continue
        if opts.max_iterations is not None and stats.iterations >= opts.max_iterations:
            raise SimulationError(f"stopped after max_iterations={opts.max_iterations}")
        plan_t = clock.now
        plan = core.schedule()
        if plan.is_empty:
            if in_flight:
                # Idle until a swap-in lands (or a request arrives).
                nxt = in_flight[0][0]
                if i < n:
                    nxt = min(nxt, reqs[i].arrival_time)
                clock.now = max(clock.now, nxt)
                done = landed_by(clock.now)
                if done:
                    result = StepResult(plan.step, [], 0.0, swaps_in_done=done)
                    core.complete(plan, result)
                    if opts.trace:
                        trace.append(StepTrace.of(plan_t, plan, result))
                continue
            if i < n:
                clock.now = max(clock.now, reqs[i].arrival_time)
                continue
            raise SimulationError(
                f"scheduler made no progress at t={clock.now:.3f} with "
                f"{len(core.jobs)} jobs left (KV too small for one of them?)"
            )
        shape = BatchShape.of(plan)
        if not plan.chunks and not shape.swap_blocks:
            idle_plans += 1
            if idle_plans > 1000:
                raise SimulationError(f"scheduler spins without work at t={clock.now:.3f}")
        else:
            idle_plans = 0
        compute = cost.iteration_time(shape)
        ins: dict[str, int] = {}  # job -> blocks, in op order
        n_out = 0
        for op in plan.block_ops:
            if op.kind is BlockOpKind.SWAP_IN:
                ins[op.job_id] = ins.get(op.job_id, 0) + 1
            elif op.kind is not BlockOpKind.DROP:
                n_out += 1
        n_in = sum(ins.values())
        start = clock.now
        if opts.overlap_swap:
            out_t = cost.swap_time(n_out) if n_out else 0.0
            exposed_swap = max(0.0, out_t - compute)
            dt = compute + exposed_swap
            for jid, nb in ins.items():
                lane_start = max(in_lane_free, start)
                in_lane_free = lane_start + cost.swap_time(nb)
                stats.swap_in_lane_busy += in_lane_free - lane_start
                seq += 1
                heapq.heappush(in_flight, (in_lane_free, seq, jid))
                issued_at[jid] = start
        else:
            swap = cost.swap_time(n_in + n_out) if (n_in + n_out) else 0.0
            exposed_swap = swap
            dt = compute + swap
            for jid in ins:
                seq += 1
                heapq.heappush(in_flight, (start + dt, seq, jid))
                issued_at[jid] = start
        # Jobs left waiting by this plan: the batch runs saturated.
        backlog = policy.num_waiting() > 0
        clock.now += dt
        stats.iterations += 1
        stats.busy_time += dt
        stats.exposed_swap_time += exposed_swap
        stats.num_preemptions += len(plan.preempted)
        stats.sum_batch_size += len(plan.chunks)
        stats.sum_batch_tokens += shape.num_tokens
        if n_in or n_out:
            stats.swap_blocks += n_in + n_out
            stats.swap_in_blocks += n_in
            stats.swap_out_blocks += n_out
            for op in plan.block_ops:
                if op.kind is not BlockOpKind.DROP:
                    swap_blocks[op.job_id] = swap_blocks.get(op.job_id, 0) + 1
        for c in plan.chunks:
            exec_time[c.job_id] += compute
            if exposed_swap:
                swap_time[c.job_id] += exposed_swap
        outputs = [JobOutput(c.job_id, SAMPLED_TOKEN_ID) for c in plan.chunks if c.sample]
        result = StepResult(plan.step, outputs, dt)
        done = landed_by(clock.now)
        if done:
            result.swaps_in_done = done
        events = core.complete(plan, result)
        if opts.trace:
            trace.append(StepTrace.of(plan_t, plan, result))
        now = clock.now
        for ev in events:
            token_times[ev.job_id].append(now)
        if backlog:
            stats.last_backlog_time = now
            stats.finished_at_last_backlog = core.num_finished
        if abort_nl is not None and stats.iterations % 64 == 0:
            _check_abort(now)

    stats.swap_bytes = stats.swap_blocks * block_bytes
    stats.wall_time = time.perf_counter() - wall0
    records: list[RequestRecord] = []
    for r in reqs:
        rid = r.request_id
        job = jobs.get(rid)
        if job is None:
            records.append(
                RequestRecord(
                    request_id=rid,
                    job_class=r.job_class,
                    scheduled_time=r.arrival_time,
                    send_time=r.arrival_time,
                    prompt_tokens=r.prompt_tokens,
                    expected_output_tokens=r.output_tokens,
                    error=errors.get(rid, "not admitted"),
                )
            )
            continue
        end = job.finish_time
        e2e = (end - r.arrival_time) if end is not None else math.nan
        ex, sw = exec_time[rid], swap_time[rid]
        # model_construct: these values are ours, skip re-validating
        # thousands of token-time lists.
        records.append(
            RequestRecord.model_construct(
                request_id=rid,
                job_class=r.job_class,
                scheduled_time=r.arrival_time,
                send_time=r.arrival_time,
                token_times=token_times[rid],
                end_time=end,
                prompt_tokens=r.prompt_tokens,
                output_tokens=job.num_output_tokens,
                expected_output_tokens=r.output_tokens,
                error=None if end is not None else "unfinished",
                num_preemptions=job.num_preemptions,
                queueing_time=max(0.0, e2e - ex - sw) if end is not None else None,
                execution_time=ex,
                swap_time=sw,
                swap_bytes=swap_blocks.get(rid, 0) * block_bytes,
            )
        )
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
