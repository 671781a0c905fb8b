"""Several engine replicas on one virtual clock, placed and autoscaled by
the server's own code: the simulator (bench/simulator.py) at cluster scale.

Each replica is what `simulate` steps -- a `SchedulerCore` with the policy
and a `SimulatedExecutor` on the cost model, driven by the server's
`IterationDriver` -- with a virtual clock of its own that says when its
device is next free.  One loop takes events in time order:

- an **arrival** goes to the replica `scheduler.placement.Placement.place`
  picks from the replicas' last load reports (the Scheduler deployment's
  placement when admission control is off, by load alone here: jobs placed
  since the last report counted on top); a replica busy with an iteration
  takes it at its next plan, as a live one does;
- a **load report** every `report_interval_s` (deployments/engine.py,
  `REPORT_INTERVAL_S`): each ready replica's figures, as
  `Engine._report_loop` computes them;
- an **autoscaling tick** every `metrics_interval_s` (app/builder.py): each
  ready replica's signals (`scheduler.autoscale.replica_signals`, as
  `Engine.record_autoscaling_stats` makes them), averaged over Serve's
  look-back window, go to `scheduler.autoscale.desired_replicas`, bounded by
  min/max replicas as Serve bounds them.  A new replica reports its first
  load `startup_s` later (weights and profiling) and takes jobs from then
  on.  A replica let go takes no new job and stops once its jobs are done
  (Serve's graceful shutdown; the Engine's drain allows 300 s, which no run
  here needs): Serve stops the one with the fewest jobs first here;
- otherwise the ready replica whose clock is earliest runs an iteration.

Replica-seconds count every replica from its start to its stop, starting
and draining ones too: what the deployment costs.

Simplifications, said here so that no figure is read beyond them: the
policy is called once a metrics interval (Serve's control loop runs every
0.1 s, on metrics that change once a second); the iteration cost is the
cost model's, so a replica's measured slowdown is 1; admission control is
not modelled; placement passes no prefix or cache keys, so it has no
prefix or cache-key affinity.  Under `policy: conserve` offline requests
wait in the Scheduler's offline pool (bench/cluster_pool.py) unless
`offline_pool.enabled` is off, as live.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

from bench.cluster_pool import SimPool
from bench.costmodel import CostModel
from bench.records import RequestRecord
from bench.sim_executor import SimulatedExecutor, VirtualClock
from bench.simulator import (
    CostEstimatorAdapter,
    SimulationError,
    _block_bytes,
    make_core,
    make_job,
    request_record,
)
from bench.workload import RequestSpec
from scheduler.admission import AdmissionBound, MeanOutput, bounded, load_report
from scheduler.autoscale import (
    AutoscaleSettings,
    ReplicaSignals,
    desired_replicas,
    kv_use,
    online_cadence,
    replica_signals,
    tpot_ratio,
)
from scheduler.config import OfflinePoolConfig, SchedulerConfig
from scheduler.cost import LinearCost
from scheduler.iteration import IterationDriver
from scheduler.job import Job, JobClass
from scheduler.placement import Placement


class ClusterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Replicas at t = 0 (all of them, without autoscaling).
    replicas: int = Field(1, ge=1)
    autoscaling: AutoscaleSettings = AutoscaleSettings()
    # From Serve starting a replica to its first load report.
    startup_s: float = Field(30.0, ge=0)
    report_interval_s: float = Field(0.5, gt=0)
    metrics_interval_s: float = Field(1.0, gt=0)
    look_back_s: float = Field(5.0, gt=0)
    # The TTFT objective of the replicas' estimate (`admission.ttft_slo_s`).
    ttft_slo_s: float = Field(2.0, gt=0)
    # As `SimOptions.overlap_swap`: KV copies overlap compute.
    overlap_swap: bool = False
    padding_ratio: float = Field(0.15, ge=0)
    # The Scheduler's offline pool, under `policy: conserve`.
    offline_pool: OfflinePoolConfig = OfflinePoolConfig()
    # The replicas share one host KV tier, as the server's object-store
    # tier is: a started offline request may move with its KV there
    # (`offline_pool.move_queued`); false: only unstarted ones move.
    shared_host_tier: bool = True


def linear_cost(cost: CostModel) -> LinearCost:
    """The iteration-cost line a replica's profiler would fit on this cost
    model (engine/profiler.py, `estimate_cost`: prompts of 16 and 256
    tokens, decodes at batch 1 and 8)."""
    est = CostEstimatorAdapter(cost)
    short, long = est.prefill_time(16), est.prefill_time(256)
    per_token = max(0.0, (long - short) / 240)
    lone, eight = est.decode_time(1), est.decode_time(8)
    per_seq = max(0.0, (eight - lone) / 7)
    return LinearCost(base_s=max(1e-4, short - 16 * per_token), prefill_per_token_s=per_token,
                      decode_per_seq_s=per_seq, decode_base_s=lone - per_seq)


@dataclass
class Replica:
    name: str
    started_at: float
    ready_at: float
    clock: VirtualClock
    device: SimulatedExecutor
    driver: IterationDriver
    mean_output: MeanOutput
    stopping_at: float | None = None
    stopped_at: float | None = None
    last_decode_end: float | None = None
    decode_gaps: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=4096))
    # (time, signals) of each metrics tick within the look-back window.
    samples: deque[tuple[float, dict[str, float]]] = field(default_factory=deque)
    iterations: int = 0
    # Its latest load report's admission figures, which the autoscaling
    # stats reuse as the engine's do (deployments/engine.py).
    figures: dict[str, Any] | None = None

    @property
    def core(self) -> Any:
        return self.driver.core

    def ready(self, now: float) -> bool:
        return self.ready_at <= now and self.stopped_at is None


@dataclass
class ClusterOutput:
    records: list[RequestRecord]
    end_time: float
    # (time, replicas started and not stopped, of which ready) at each change.
    timeline: list[tuple[float, int, int]]
    replica_seconds: float
    stats: dict[str, Any]


class Cluster:
    def __init__(self, requests: Sequence[RequestSpec], scheduler: SchedulerConfig,
                 cost: CostModel, options: ClusterOptions) -> None:
        self.opts = options
        self.scale = options.autoscaling
        self.sched = scheduler
        self.cost = cost
        self.line = linear_cost(cost)
        self.lone_decode = self.line.decode_time(1)
        self.bound = AdmissionBound(options.ttft_slo_s)
        self.reqs = sorted(requests, key=lambda r: r.arrival_time)
        self.i = 0
        self.placement = Placement(stale_after_s=math.inf, block_size=scheduler.block_size)
        self.replicas: list[Replica] = []
        self.names = itertools.count()
        self.tokens = itertools.count(1)
        self.jobs: dict[str, Job] = {}
        self.where: dict[str, Replica] = {}
        self.token_times: dict[str, list[float]] = {}
        self.errors: dict[str, str] = {}
        self.state: dict[str, Any] = {}
        self.target = options.replicas
        self.timeline: list[tuple[float, int, int]] = []
        self.decisions: list[tuple[float, int]] = []
        self.pool = (SimPool(options.offline_pool, self._place, options.shared_host_tier)
                     if scheduler.policy == "conserve" and options.offline_pool.enabled
                     else None)
        for _ in range(options.replicas):
            self._start(0.0, ready_at=0.0)

    # -- replicas -----------------------------------------------------------------

    def _start(self, now: float, ready_at: float) -> None:
        clock = VirtualClock(ready_at)
        core = make_core(self.sched, clock, self.cost)
        device = SimulatedExecutor(self.cost, clock, self.opts.overlap_swap, self._next_event)
        self.replicas.append(Replica(
            f"engine-{next(self.names)}", now, ready_at, clock, device,
            IterationDriver(core, device), MeanOutput(256.0)))

    def _stop_one(self, now: float) -> None:
        """Serve stops a replica still starting first, else (here) the
        ready one holding the fewest jobs; it drains."""
        alive = [r for r in self.replicas if r.stopping_at is None and r.stopped_at is None]
        starting = [r for r in alive if r.ready_at > now]
        victim = starting[-1] if starting else min(
            alive, key=lambda r: (len(r.core.jobs), -r.started_at))
        victim.stopping_at = now
        self.placement.forget(victim.name)
        if self.pool is not None:
            self.pool.forget(victim.name)
        if victim.ready_at > now or not victim.core.has_work:
            victim.stopped_at = now

    def _alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.stopped_at is None]

    def _note(self, now: float) -> None:
        alive = self._alive()
        point = (now, len(alive), sum(r.ready_at <= now for r in alive))
        if not self.timeline or self.timeline[-1][1:] != point[1:]:
            self.timeline.append(point)

    # -- events -------------------------------------------------------------------

    def _next_event(self) -> float | None:
        """The next arrival: a replica waiting for a swap-in waits no longer."""
        return self.reqs[self.i].arrival_time if self.i < len(self.reqs) else None

    def _arrive(self, r: RequestSpec, now: float) -> None:
        rid = r.request_id
        if self.pool is not None and r.job_class == JobClass.OFFLINE.value:
            self.pool.add(r, now)
            return
        tokens = r.prompt_tokens + (r.max_tokens or r.output_tokens)
        name = self.placement.place(rid, tokens, now)
        rep = next((x for x in self.replicas if x.name == name), None)
        if rep is None:
            self.errors[rid] = "no replica ready"
            return
        self._place(r, rep, now)

    def _place(self, r: RequestSpec, rep: Replica, now: float) -> None:
        rid = r.request_id
        moved = self.jobs.get(rid)  # moved here after it started elsewhere
        job = make_job(r, next(self.tokens), rep.device, self.opts.padding_ratio)
        host_blocks = 0
        if moved is not None and moved.output_token_ids:
            # As the server resumes it: from the tokens its client has and
            # the blocks its old replica left in the host tier.
            job.prompt_token_ids = moved.prompt_token_ids
            job.output_token_ids = list(moved.output_token_ids)
            host_blocks = self.pool.carried.pop(rid, 0) if self.pool is not None else 0
        try:
            rep.core.add(job, host_blocks=host_blocks)
        except ValueError as e:
            self.errors[rid] = f"rejected: {e}"
            return
        # An idle replica's clock stopped when it ran out of work.
        rep.clock.now = max(rep.clock.now, now)
        self.jobs[rid] = job
        self.where[rid] = rep
        self.token_times.setdefault(rid, [])

    def _report(self, rep: Replica, now: float) -> None:
        core = rep.core
        jobs = list(core.jobs.values())
        queued = sum(j.max_total_tokens - j.num_computed_tokens for j in jobs)
        figures = rep.figures = self._admission_figures(rep, jobs)
        self.placement.report(rep.name, core.config.num_blocks, core.blocks.num_free, queued,
                              len(jobs), now, **figures)
        if self.pool is not None:
            self.pool.report(rep, now)

    def _admission_figures(self, rep: Replica, jobs: list[Job]) -> dict[str, Any]:
        cfg = rep.core.config
        held = [j for j in jobs if bounded(j.job_class.value, cfg.policy)]
        return load_report(held, rep.core.batch, rep.mean_output.value, None, self.bound,
                           cfg.max_batch_size, cfg.max_batch_tokens, self.line)

    def _signals(self, rep: Replica, now: float) -> dict[str, float]:
        core = rep.core
        jobs = list(core.jobs.values())
        online = sum(1 for j in jobs if j.job_class is JobClass.ONLINE)
        kv = kv_use(jobs, core.blocks.num_free, core.config.num_blocks, core.config.policy)
        since = now - self.scale.tpot_window_s
        gaps = [g for t, g in rep.decode_gaps if t >= since]
        tpot = tpot_ratio(gaps, self.lone_decode, self.scale.tpot_slo_s or 3 * self.lone_decode)
        figures = rep.figures if rep.figures is not None else self._admission_figures(rep, jobs)
        return replica_signals(figures, kv, online,
                               len(jobs) - online, self.scale.typical_prompt_tokens, tpot)

    def _autoscale(self, now: float) -> None:
        if not self.scale.enabled:
            return
        signals: dict[str, ReplicaSignals] = {}
        for rep in self._alive():
            if not rep.ready(now) or rep.stopping_at is not None:
                continue
            rep.samples.append((now, self._signals(rep, now)))
            while rep.samples and rep.samples[0][0] <= now - self.opts.look_back_s:
                rep.samples.popleft()
            keys = rep.samples[0][1].keys()
            mean = {k: sum(s[k] for _, s in rep.samples) / len(rep.samples) for k in keys}
            signals[rep.name] = ReplicaSignals.of(mean)
        wanted, self.state = desired_replicas(signals, self.target, self.scale, self.state, now)
        wanted = min(max(wanted, self.scale.min_replicas), self.scale.max_replicas)
        if wanted != self.target:
            self.decisions.append((now, wanted))
        for _ in range(wanted - self.target):
            self._start(now, now + self.opts.startup_s)
        for _ in range(self.target - wanted):
            self._stop_one(now)
        self.target = wanted

    def _step(self, rep: Replica) -> None:
        it = rep.driver.step()
        now = rep.clock.now
        if it.plan.is_empty:
            if not rep.device.swaps_in_flight and it.planned_at == now:
                raise SimulationError(
                    f"{rep.name} made no progress at t={now:.3f} with {len(rep.core.jobs)} "
                    "jobs (KV too small for one of them?)")
            return
        if it.result.interrupted:
            return
        rep.iterations += 1
        # The replica's jobs, and those this iteration finished (the engine
        # loop's view when it counts the iteration).
        ended = {ev.job_id: self.jobs[ev.job_id] for ev in it.events if ev.finished}
        decodes, held, share = online_cadence(
            it.plan, {**rep.core.jobs, **ended} if ended else rep.core.jobs, self.line)
        if decodes:
            if rep.last_decode_end is not None:
                rep.decode_gaps.append((now, share * (now - rep.last_decode_end)))
            rep.last_decode_end = now
        elif not held:
            rep.last_decode_end = None
        for ev in it.events:
            times = self.token_times[ev.job_id]
            times.append(now)
            if self.pool is not None and len(times) == 1 and \
                    self.jobs[ev.job_id].job_class is JobClass.OFFLINE:
                self.pool.first_token(rep.name)
            if ev.finished:
                job = self.jobs[ev.job_id]
                rep.mean_output.add(job.num_output_tokens)
                if self.pool is not None and job.job_class is JobClass.OFFLINE:
                    self.pool.finished(ev.job_id, now)
        if not rep.core.has_work:
            rep.last_decode_end = None  # idle: the next decode starts a new cadence
            if rep.stopping_at is not None:
                rep.stopped_at = now

    def run(self) -> ClusterOutput:
        wall0 = time.perf_counter()
        next_report = next_tick = 0.0
        n = len(self.reqs)
        while True:
            arrival = self.reqs[self.i].arrival_time if self.i < n else math.inf
            busy = [r for r in self.replicas if r.stopped_at is None and r.core.has_work]
            if self.i >= n and not busy and not (self.pool and len(self.pool)):
                break
            step_at, rep = min(((r.clock.now, k) for k, r in enumerate(busy)),
                               default=(math.inf, -1))
            now = min(arrival, next_report, next_tick, step_at)
            if now == next_report:
                for r in self._alive():
                    if r.ready(now) and r.stopping_at is None:
                        self._report(r, now)
                next_report += self.opts.report_interval_s
            elif now == next_tick:
                self._autoscale(now)
                self._note(now)
                next_tick += self.opts.metrics_interval_s
            elif now == arrival:
                self._arrive(self.reqs[self.i], now)
                self.i += 1
            else:
                self._step(busy[rep])
        end = max([r.clock.now for r in self.replicas] + [next_tick - self.opts.metrics_interval_s])
        self._note(end)
        for r in self._alive():
            r.stopped_at = end
        block_bytes = _block_bytes(self.cost)
        records = [request_record(
            r, self.jobs.get(r.request_id), self.token_times.get(r.request_id, []),
            self.where[r.request_id].device if r.request_id in self.where
            else self.replicas[0].device, block_bytes, self.errors.get(r.request_id))
            for r in self.reqs]
        seconds = sum((r.stopped_at or end) - r.started_at for r in self.replicas)
        stats = {
            "replicas_started": len(self.replicas),
            "max_replicas_alive": max(p[1] for p in self.timeline),
            "decisions": self.decisions,
            "iterations": {r.name: r.iterations for r in self.replicas},
            "offline_moved": self.pool.num_moved if self.pool is not None else 0,
            "offline_moved_started": (self.pool.num_moved_started if self.pool is not None
                                      else 0),
            "wall_time": time.perf_counter() - wall0,
        }
        return ClusterOutput(records, end, self.timeline, seconds, stats)


def simulate_cluster(requests: Sequence[RequestSpec], scheduler: SchedulerConfig,
                     cost: CostModel, options: ClusterOptions | None = None) -> ClusterOutput:
    return Cluster(requests, scheduler, cost, options or ClusterOptions()).run()
