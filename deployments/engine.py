"""The Engine deployment: one model instance and its iteration loop.

Each replica owns a placement group (a CPU bundle here, GPU bundles with
`device: cuda`), a `ModelRunner` with its paged KV cache, and a
`SchedulerCore` running the configured policy.  `generate` streams a job's
output; tokens from one iteration are handed to the asyncio side in one
call.  A cancelled stream (client gone) aborts its job and frees its blocks.

Its host KV tier is the application's directory, which the Scheduler
deployment owns (`Scheduler.kv_directory`); without a scheduler the replica
makes a directory of its own.

Shutdown: `stop_serving(reason)` (called for every replica by
`Scheduler.shutdown_engines` before the CLI stops Serve) and `__del__`
(which Serve calls once a replica stopping gracefully has drained) end the
iteration loop: each job still running ends its stream with
`EngineStopped(reason)`, later requests get the same at once, and the KV
tier's copy thread stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import asdict
from typing import Any, AsyncIterator

from ray import serve

from api.config import AppConfig
from api.protocol import GenerateDelta, GenerateRequest, WireLogprob
from deployments import STOP_POLL_S
from deployments.engine_figures import EngineFigures
from deployments.delivery import Delivery, EngineStopped, JobMoved
from deployments.engine_loop import EngineLoop, choice_job_ids
from deployments.engine_metrics import EngineMetrics
from deployments.engine_pinning import pin_replica
from deployments.engine_priority import give_nice, loop_nice
from deployments.generate_request import sampling_params
from deployments.handles import by_value
from deployments.stream_pacing import StreamPacer
from engine.gc_heap import prepare_serving_heap
from scheduler.admission import AdmissionBound
from scheduler.core import SchedulerCore
from scheduler.config import SchedulerConfig
from scheduler.cost import CostEstimator, LinearCost
from scheduler.cost_fit import LiveCost, typical_batch
from scheduler.job import JobClass
from scheduler.offline_pool import recompute_bound

log = logging.getLogger("ray.serve")

REPORT_INTERVAL_S = 0.5

def _graph_limits(cfg: AppConfig, sched: Any) -> tuple[int, int]:
    """(requests, tokens) of the largest step captured in CUDA graphs
    ((0, 0): none): the most an iteration may run, on CUDA with the triton
    backend, without tensor or pipeline parallelism."""
    if not cfg.cuda_graphs or cfg.device != "cuda" or cfg.attention_backend not in (
            "auto", "triton") or cfg.tensor_parallel_size * cfg.pipeline_parallel_size > 1:
        return 0, 0
    off = sched.conserve
    return (max(sched.max_batch_size, off.offline_max_batch_size or 0),
            max(sched.max_batch_tokens, off.offline_max_batch_tokens or 0))


class _StoppedJobLogs(logging.Filter):
    """Serve logs every exception a request raises as "Request failed." with
    its traceback.  A job ended on purpose by a shutdown is not a failure:
    its record keeps one line, at INFO, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, EngineStopped):
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "Request ended by the engine replica stopping: %s", (exc,)
        return True


def _wire(lp: Any) -> dict[str, Any]:
    return {"logprob": lp.logprob, "top": lp.top, "rank": lp.rank}


def _start_costs(runner: Any, cfg: AppConfig, sched_cfg: SchedulerConfig,
                 needs_cost: bool) -> tuple[LinearCost | None, float]:
    """The iteration cost model (where anything reads it) and admission's
    full-batch tokens/s until the loop measures one under real load: from
    `iteration_cost` where the config pins it, else timed on the model."""
    batch = sched_cfg.max_batch_size
    if cfg.iteration_cost is not None:
        cost = cfg.iteration_cost.cost()
        log.info("iteration cost pinned by the config: %s", cost)
        return cost, batch / cost.decode_time(batch)
    from engine.profiler import estimate_cost, full_batch_throughput

    tokens_per_s = full_batch_throughput(runner, sched_cfg.block_size, batch)
    if not needs_cost:
        return None, tokens_per_s
    cost = estimate_cost(runner, sched_cfg.block_size)
    pin = {k: v for k, v in asdict(cost).items() if v is not None}
    log.info("iteration cost timed at start; to pin it: iteration_cost: %s", json.dumps(pin))
    return cost, tokens_per_s


@serve.deployment(name="Engine", max_ongoing_requests=4096, health_check_period_s=10,
                  graceful_shutdown_wait_loop_s=STOP_POLL_S)
class Engine(EngineFigures):
    async def __init__(self, config: dict[str, Any], scheduler: Any = None) -> None:
        from engine.dtypes import resolve_dtype
        from engine.model_source import resolve_model
        from engine.runner import ModelRunner
        from engine.threads import side_pool

        self.cfg = AppConfig(**config)
        # Before the runner starts torch's thread pool, which inherits it.
        pin_replica(self.cfg)
        nice = loop_nice(self.cfg.engine_nice)  # checked now: a refused value stops the start
        self._side = side_pool("grammar")  # after `_pin`: it leaves the engine's cores
        sched_cfg = self.cfg.scheduler_config()
        graph_batch, graph_tokens = _graph_limits(self.cfg, sched_cfg)
        runner_kwargs: dict[str, Any] = dict(
            model_path=str(resolve_model(self.cfg.model)),
            dtype=resolve_dtype(self.cfg.dtype, self.cfg.device),
            device=self.cfg.device,
            num_blocks=sched_cfg.num_blocks,
            block_size=sched_cfg.block_size,
            max_model_len=sched_cfg.max_model_len,
            num_threads=self.cfg.threads,
            attention_backend=(
                None if self.cfg.attention_backend == "auto" else self.cfg.attention_backend),
            deterministic=self.cfg.deterministic,
            cuda_graph_max_batch=graph_batch,
            cuda_graph_max_tokens=graph_tokens,
            pack_projections=self.cfg.pack_projections,
            weight_codes=self.cfg.weight_codes,
            lora_adapters=dict(self.cfg.lora_adapters) or None,
            max_lora_loaded=self.cfg.lora_runtime.max_loaded,
        )
        # The model's other tensor-parallel shards and pipeline stages, in
        # this replica's placement group; this process is global rank 0
        # (engine/shards.py).
        self.shards: Any = None
        world = self.cfg.tensor_parallel_size * self.cfg.pipeline_parallel_size
        if world > 1:
            from deployments.shard_workers import RayShardGroup

            self.shards = RayShardGroup(self.cfg.tensor_parallel_size, runner_kwargs,
                                        stages=self.cfg.pipeline_parallel_size,
                                        device=self.cfg.device)
            tp, pp = await asyncio.to_thread(self.shards.join)
            # Only the driving rank reads the final hidden states.
            self.runner = ModelRunner(**runner_kwargs, tensor_parallel=tp, pipeline=pp,
                                      length_head=self.cfg.predictor.engine_head)
            await asyncio.to_thread(self.shards.wait_ready)
            self.runner.attach_shards(self.shards)
        else:
            self.runner = ModelRunner(**runner_kwargs, length_head=self.cfg.predictor.engine_head)
        if not any(isinstance(f, _StoppedJobLogs) for f in log.filters):
            log.addFilter(_StoppedJobLogs())
        # Set when this replica is deliberately stopped (stop_serving, __del__).
        self._closing = False
        self.kv_tier: Any = None
        if sched_cfg.host_kv_blocks:
            # This replica's share of the application's directory.
            owner = serve.get_replica_context().replica_id.unique_id
            self.kv_tier = await _host_tier(sched_cfg.host_kv_blocks * world, scheduler, owner)
            self.runner.set_kv_tier(self.kv_tier)
            if self.shards is not None:
                tier = self.kv_tier
                await asyncio.to_thread(self.shards.set_kv_tier, tier.directory, tier.name,
                                        tier.namespace, owner)
        adm = self.cfg.admission
        self.bound = AdmissionBound(adm.ttft_slo_s, adm.max_queued_tokens,
                                    adm.max_backlog_s if adm.per_queue_wait else None)
        # The TTFT estimate of admission control needs the cost model
        # (scheduler/admission.py), as every policy but FCFS does.
        self.ttft_admission = adm.enabled and adm.max_queued_tokens is None
        needs_cost = (self.cfg.policy != "fcfs" or self.ttft_admission
                      or self.cfg.autoscaling.enabled)
        cost, self.start_tokens_per_s = _start_costs(self.runner, self.cfg, sched_cfg, needs_cost)
        self.cost = cost
        # What the policy's estimate is: the co-serving budget's follows the
        # replica's measured iterations (scheduler/cost_fit.py).
        policy_cost: CostEstimator | None = None if self.cfg.policy == "fcfs" else cost
        self.live_cost: LiveCost | None = None
        if cost is not None and self.cfg.policy == "conserve" \
                and sched_cfg.conserve.cost_fit == "live":
            typical = typical_batch(sched_cfg.max_batch_size, sched_cfg.max_batch_tokens,
                                    sched_cfg.max_model_len)
            self.live_cost = policy_cost = LiveCost(cost, typical,
                                                    memory=sched_cfg.conserve.cost_memory)
        self.core = SchedulerCore(sched_cfg, time.monotonic, cost=policy_cost)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.scheduler = by_value(scheduler)
        self._aio = asyncio.get_running_loop()
        # Job id -> (its call's delivery queue, prompt number, choice index).
        self._streams: dict[str, tuple[asyncio.Queue[Delivery], int, int]] = {}
        # Offline `generate` calls accepted (scheduler/offline_pool.py).
        self.offline_accepted = 0
        self.loop = EngineLoop(self.runner, self.core, sampling_params, self._deliver,
                               cost=cost, live_cost=self.live_cost,
                               ahead=self.cfg.schedules_ahead)
        # Started offline requests may move, their KV through the
        # application's tier (every shard's slices of it, flushed before the
        # move, `_flush_tiers`), and at most about an iteration's prefill of
        # it recomputed (deployments/resume.py).
        if scheduler is not None:
            self.loop.move_recompute_blocks = recompute_bound(sched_cfg)
        prepare_serving_heap()
        self.loop.start()
        give_nice(nice)
        self.head_source = self.cfg.predictor.engine_head
        self.metrics = EngineMetrics(self.replica_id)
        # The load reporter's latest admission figures (monotonic time,
        # figures), which the autoscaling stats reuse.
        self._last_admission: tuple[float, dict[str, Any]] = (-math.inf, {})
        self._reporter = asyncio.create_task(self._report_loop())

    # Called on the loop thread once per iteration with all its tokens.
    def _deliver(self, items: list[Delivery]) -> None:
        self._aio.call_soon_threadsafe(self._dispatch, items)

    def _dispatch(self, items: list[Delivery]) -> None:
        for d in items:
            target = self._streams.get(d.event.job_id)
            if target is not None:
                target[0].put_nowait(d)

    def _flush_tiers(self) -> None:
        """Wait for the host copies this replica has queued: its own tier's
        (one FIFO writer, kvstore/tier.py) and every other shard's."""
        self.kv_tier.flush()
        if self.shards is not None:
            self.shards.flush_kv_tier()

    async def _checkpointed(self, req: GenerateRequest) -> list[int] | None:
        """Per choice of a request resumed from a failed replica, or moved
        here from another after it started (scheduler/offline_pool.py), the
        KV blocks that replica's checkpoints (`survival.checkpoint`,
        ConServe's of offline jobs) or swaps left in the application's host
        tier; None where there is nothing to look up.
        A split model's shards each stored a slice of every block under a
        key of its own: the blocks every shard stored count, and only a
        replica split the same way finds them (`engine/shards.py`)."""
        tier = self.kv_tier
        if tier is None or not (self.cfg.survival.checkpoint
                                or req.job_class == JobClass.OFFLINE.value):
            # Only those two copy a job's blocks for another replica; a
            # lookup waits for this replica's queued copies.
            return None
        from engine.shards import held_by_every_shard

        assert req.resume is not None
        world = self.runner.world

        def count(job_id: str) -> int:
            return tier.held(job_id) if world == 1 else held_by_every_shard(
                tier.held, job_id, world)

        ids = choice_job_ids(req.request_id, req.n)
        held = [0 if out is None else await asyncio.to_thread(count, job_id)
                for job_id, out in zip(ids, req.resume)]
        log.info("request %s resumes with %s KV blocks of its choices checkpointed",
                 req.request_id, held)
        return held

    async def generate(self, requests: list[dict[str, Any]], replica: str | None = None
                       ) -> AsyncIterator[list[dict[str, Any]]]:
        """Stream the output of one client request: its prompts (one
        `GenerateRequest` each) with their `n` choices.  Each item lists, per
        choice with news since the last item, a `GenerateDelta` dump.

        One call per client request, whatever its number of prompts: Serve
        did not dispatch a second concurrent call from the same parent
        request to the same replica (ingress → engine, Ray 2.60)."""
        reqs = [GenerateRequest(**r) for r in requests]
        if reqs and reqs[0].job_class == JobClass.OFFLINE.value:
            # The offline pool's proof that a request it handed out arrived.
            self.offline_accepted += 1
        q: asyncio.Queue[Delivery] = asyncio.Queue()
        running: set[str] = set()
        for p, req in enumerate(reqs):
            req.arrival_time = time.monotonic()
            self.loop.stats.arrival_times.append((req.arrival_time, req.request_id))
            for i, job_id in enumerate(choice_job_ids(req.request_id, req.n)):
                if req.resume is not None and req.resume[i] is None:
                    continue  # finished on the replica this request resumes from
                self._streams[job_id] = (q, p, i)
                running.add(job_id)
        jobs = list(running)
        # Whether its client has tokens: only then does a move keep host
        # copies for its next replica (deployments/engine_loop.py).
        has_tokens = any(out for req in reqs for out in req.resume or ())
        pacer = StreamPacer(any(req.streamed for req in reqs),
                            reqs[0].stream_interval if reqs else 1, time.monotonic())
        deltas: dict[tuple[int, int], GenerateDelta] = {}
        try:
            for req in reqs:
                if req.resume is not None:
                    req.resume_kv_blocks = await self._checkpointed(req)
                if req.structured is not None:
                    # Compiled here, off the loop's thread, which finds it
                    # cached: no running request waits for a large schema.
                    await asyncio.get_running_loop().run_in_executor(
                        self._side, self.runner.grammars.prepare, req.structured)
                # One prompt of an offline request: the replica may give
                # it back unstarted (scheduler/offline_pool.py).
                self.loop.submit(req, movable=len(reqs) == 1)
            while running:
                items = await pacer.next_items(q)
                for d in items:
                    if d.error is not None:
                        if deltas:  # output held back: a resume starts after it
                            yield [dl.model_dump() for dl in deltas.values()]
                            deltas = {}
                        if d.moved and has_tokens and self.kv_tier is not None:
                            # Its host copies land before another replica
                            # looks them up.
                            await asyncio.to_thread(self._flush_tiers)
                        # ValueError: the request was refused (the client's
                        # 400); the others are this replica's failures.
                        kind = (EngineStopped if d.stopped else JobMoved if d.moved
                                else RuntimeError if d.internal else ValueError)
                        raise kind(d.error)
                    ev = d.event
                    _, p, index = self._streams[ev.job_id]
                    delta = deltas.get((p, index))
                    if delta is None:
                        delta = deltas[p, index] = GenerateDelta(
                            prompt=p, index=index, token_ids=[], text="")
                    if ev.token_id is not None:
                        has_tokens = True
                        if ev.accepted:
                            delta.token_ids += ev.accepted
                        delta.token_ids.append(ev.token_id)
                        if ev.logprobs is not None:
                            delta.logprobs = (delta.logprobs or []) + [
                                WireLogprob.model_validate(_wire(ev.logprobs))]
                    if ev.prompt_logprobs is not None:
                        delta.prompt_logprobs = [
                            None if x is None else WireLogprob.model_validate(_wire(x))
                            for x in ev.prompt_logprobs]
                    delta.text += ev.text
                    if ev.finished:
                        running.discard(ev.job_id)
                        delta.finish_reason = ev.finish_reason
                        delta.stop_reason = ev.stop_reason
                        delta.metrics = d.metrics
                if not pacer.due(deltas, bool(running), time.monotonic()):
                    continue
                yield [dl.model_dump() for dl in deltas.values()]
                pacer.sent(deltas, time.monotonic())
                deltas = {}
        finally:
            for job_id in jobs:
                self._streams.pop(job_id, None)
            if running:  # cancelled (the client went away) or failed
                for req in reqs:
                    self.loop.abort(req.request_id)

    async def set_prediction(self, request_id: str, predicted_len: int,
                             replica: str | None = None, allocation: int | None = None) -> None:
        """The predictor's response-length estimate for a running job, and
        the KV it asks for (the estimate padded, EconoServe §2.3); `replica`
        is for the request router: the job's own replica."""
        self.loop.set_prediction(request_id, predicted_len, allocation)

    async def reconfigure(self, config: dict[str, Any]) -> None:
        """Serve's lightweight update, `{"engine_head": file, "embedded" or
        None}`: the length head is replaced between two passes, without a
        restart or a dropped request (README, "The engine's length head")."""
        source = config.get("engine_head")
        if source == self.head_source:
            return
        head = None
        if source is not None:
            from engine.length_head import load_head

            r = self.runner
            head = await asyncio.to_thread(load_head, source, r.config.hidden_size,
                                           r.pp.enabled, r.device)
        self.runner.length_head = head  # read once per pass
        self.head_source = source
        log.info("length head now %s", source)

    async def check_lora(self, name: str, path: str) -> str | None:
        """Why the LoRA adapter at `path` cannot be served on this model
        (None: it can), read aside in a worker thread and then dropped: the
        check of `/v1/load_lora_adapter` (engine/lora_pool.py loads it for
        its requests)."""
        from engine.lora import AdapterError, load_adapter

        try:
            await asyncio.to_thread(load_adapter, name, path, self.runner.model)
        except AdapterError as e:
            return str(e)
        return None

    async def stats(self) -> dict[str, Any]:
        return self._snapshot()

    async def iteration_log(self) -> list[tuple[tuple[tuple[int, int], ...], float, float]]:
        """The latest iterations' chunk shapes and times (see `LoopStats`)."""
        return self.loop.stats.iteration_log()

    async def step_trace(self) -> dict[str, list[Any]]:
        """Recent plans and arrivals (`LoopStats.trace`)."""
        return self.loop.stats.trace()

    async def _report_loop(self) -> None:
        while self.loop.closed is None:
            try:
                snap = self._snapshot()
                self.metrics.update(snap)
                done = self.loop.stats.finished
                # popleft is atomic: the loop thread may append meanwhile.
                self.metrics.observe([done.popleft() for _ in range(len(done))])
                if self.scheduler is not None:
                    arrived = self.loop.stats.take_arrived()  # first: all among the jobs
                    # list() copies the dict under the GIL; the loop thread
                    # may add or drop jobs meanwhile.
                    jobs = list(self.core.jobs.values())
                    queued = sum(j.max_total_tokens - j.num_computed_tokens for j in jobs)
                    figures = self._admission_figures(jobs)
                    self._last_admission = (time.monotonic(), figures)
                    answer = await self.scheduler.report_load.remote(
                        self.replica_id, snap["num_blocks"], snap["free_blocks"], queued,
                        len(jobs), {**figures, "arrived": arrived}, offline=snap["offline"])
                    if answer and answer.get("give_back"):
                        self.loop.give_back(int(answer["give_back"]))
            except Exception:  # the scheduler may be restarting; keep serving
                log.exception("load report failed")
            await asyncio.sleep(REPORT_INTERVAL_S)

    async def stop_serving(self, reason: str = "the server is shutting down",
                           replica: str | None = None) -> int:
        """End every job here with an error carrying `reason` and stop the
        loop; later requests are refused the same way (`replica` is for the
        request router).  Returns the number of jobs ended.  (Not named
        `shutdown`: a DeploymentHandle has a method of that name.)"""
        # Off the event loop: the loop thread may be inside a forward pass,
        # and the streams need this event loop to receive their errors.
        return await asyncio.to_thread(self._close, reason)

    def check_health(self) -> None:
        # A loop thread that died on its own has ended its jobs, but every
        # later request would fail: let Serve replace the replica.
        if not self.loop.alive and not self._closing:
            raise RuntimeError(f"the engine loop stopped: {self.loop.closed}")

    def _close(self, reason: str) -> int:
        self._closing = True
        ended = self.loop.shutdown(reason)
        if self.kv_tier is not None:
            self.kv_tier.close(wait=False)
        if self.shards is not None:
            self.shards.close()
        return ended

    def __del__(self) -> None:
        # Serve calls this on a graceful replica shutdown, once the replica
        # has drained; the checks cover a constructor that failed midway.
        if getattr(self, "loop", None) is None:
            return
        reporter = getattr(self, "_reporter", None)
        if reporter is not None and not reporter.done():
            try:
                reporter.cancel()
            except RuntimeError:  # its event loop is already closed
                pass
        self._close("the engine replica is shutting down")


async def _host_tier(blocks: int, scheduler: Any, owner: str) -> Any:
    """The object-store tier on the application's directory, which the
    scheduler owns, filling `owner`'s share of it; a directory of this
    replica's own without a scheduler."""
    import ray

    from kvstore.directory import DirectoryRef, KVDirectory
    from kvstore.tier import ObjectStoreTier

    if scheduler is not None:
        raw = await scheduler.kv_directory.remote()
        if raw is not None:
            ref = DirectoryRef.model_validate(raw)
            return ObjectStoreTier(ray.get_actor(ref.name, namespace=ref.namespace),
                                   name=ref.name, namespace=ref.namespace, owner=owner)
    return ObjectStoreTier(KVDirectory.remote(blocks), owner=owner)
