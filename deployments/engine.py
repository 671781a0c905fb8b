"""The Engine deployment: one model instance and its iteration loop.

Each replica owns a placement group (a CPU bundle here, GPU bundles with
`device: cuda`), a `ModelRunner` with its paged KV cache, and a
`SchedulerCore` running the configured policy.  `generate` streams a job's
output; tokens from one iteration are handed to the asyncio side in one
call.  A cancelled stream (client gone) aborts its job and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from ray import serve

from app.config import AppConfig
from app.protocol import GenerateDelta, GenerateRequest
from deployments.engine_loop import Delivery, EngineLoop
from deployments.engine_metrics import EngineMetrics
from scheduler.core import SchedulerCore

log = logging.getLogger("ray.serve")

REPORT_INTERVAL_S = 0.5


def _sampling_params(req: GenerateRequest):  # type: ignore[no-untyped-def]
    from engine.sampling_params import SamplingParams

    return SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        max_tokens=req.max_tokens,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
    )


@serve.deployment(name="Engine", max_ongoing_requests=4096, health_check_period_s=10)
class Engine:
    async def __init__(self, config: dict[str, Any], scheduler: Any = None) -> None:
        from engine.dtypes import resolve_dtype
        from engine.model_source import resolve_model
        from engine.runner import ModelRunner

        self.cfg = AppConfig(**config)
        sched_cfg = self.cfg.scheduler_config()
        self.runner = ModelRunner(
            model_path=resolve_model(self.cfg.model),
            dtype=resolve_dtype(self.cfg.dtype, self.cfg.device),
            device=self.cfg.device,
            num_blocks=sched_cfg.num_blocks,
            block_size=sched_cfg.block_size,
            max_model_len=sched_cfg.max_model_len,
            num_threads=self.cfg.threads,
        )
        if sched_cfg.host_kv_blocks:
            from kvstore.tier import ObjectStoreTier

            self.runner.set_kv_tier(ObjectStoreTier(
                sched_cfg.host_kv_blocks * self.runner.kv_block_bytes))
        cost = None
        if self.cfg.policy != "fcfs":
            from engine.profiler import estimate_cost

            cost = estimate_cost(self.runner, sched_cfg.block_size)
            log.info("iteration cost estimate: %s", cost)
        self.core = SchedulerCore(sched_cfg, time.monotonic, cost=cost)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.scheduler = scheduler
        self._aio = asyncio.get_running_loop()
        self._streams: dict[str, asyncio.Queue[Delivery]] = {}
        self.loop = EngineLoop(self.runner, self.core, _sampling_params, self._deliver)
        self.loop.start()
        self.metrics = EngineMetrics(self.replica_id)
        self._reporter = asyncio.create_task(self._report_loop())

    # Called on the loop thread once per iteration with all its tokens.
    def _deliver(self, items: list[Delivery]) -> None:
        self._aio.call_soon_threadsafe(self._dispatch, items)

    def _dispatch(self, items: list[Delivery]) -> None:
        for d in items:
            q = self._streams.get(d.event.job_id)
            if q is not None:
                q.put_nowait(d)

    async def generate(self, request: dict[str, Any], replica: str | None = None
                       ) -> AsyncIterator[dict[str, Any]]:
        req = GenerateRequest(**request)
        req.arrival_time = time.monotonic()
        rid = req.request_id
        q: asyncio.Queue[Delivery] = asyncio.Queue()
        self._streams[rid] = q
        done = False
        try:
            self.loop.submit(req)
            while not done:
                items = [await q.get()]
                while not q.empty():
                    items.append(q.get_nowait())
                delta = GenerateDelta(token_ids=[], text="")
                for d in items:
                    if d.error is not None:
                        done = True
                        raise ValueError(d.error)
                    if d.event.token_id is not None:
                        delta.token_ids.append(d.event.token_id)
                    delta.text += d.event.text
                    if d.event.finished:
                        done = True
                        delta.finish_reason = d.event.finish_reason
                        delta.metrics = d.metrics
                yield delta.model_dump()
        finally:
            self._streams.pop(rid, None)
            if not done:  # cancelled: the client went away
                self.loop.abort(rid)

    async def set_prediction(self, request_id: str, predicted_len: int,
                             replica: str | None = None) -> None:
        """The predictor's response-length estimate for a running job
        (`replica` is for the request router: the job's own replica)."""
        self.loop.set_prediction(request_id, predicted_len)

    async def stats(self) -> dict[str, Any]:
        return self._snapshot()

    async def iteration_log(self) -> list[tuple[tuple[tuple[int, int], ...], float, float]]:
        """The latest iterations' chunk shapes and times (see `LoopStats`)."""
        return list(self.loop.stats.recent_iterations.copy())

    async def step_trace(self) -> list[dict[str, Any]]:
        """Every recent plan as `scheduler.trace.StepTrace` fields."""
        return [r.to_json() for r in self.loop.stats.recent_plans.copy()]

    def _snapshot(self) -> dict[str, Any]:
        s = self.core.stats()
        ls = self.loop.stats
        return {
            "replica": self.replica_id,
            "num_waiting": s.num_waiting,
            "num_running": s.num_running,
            "free_blocks": s.num_free_blocks,
            "num_blocks": s.num_blocks,
            "num_preemptions": s.num_preemptions,
            "num_finished": s.num_finished,
            "num_aborted": s.num_aborted,
            "iterations": ls.iterations,
            "forward_time": ls.forward_time,
            "loop_time": ls.loop_time,
            "tokens_out": ls.tokens_out,
            "recent_forward_s": list(ls.recent_forward),
            "open_streams": len(self._streams),
            "swap": {
                "swap_outs": self.core.swap.num_swap_out,
                "swap_ins": self.core.swap.num_swap_in,
                "blocks_out": self.core.swap.blocks_out,
                "blocks_in": self.core.swap.blocks_in,
                "recompute_fallbacks": self.core.swap.num_recompute_fallbacks,
                "host_used_blocks": self.core.swap.host_used,
            },
            "policy": self._policy_stats(),
        }

    def _policy_stats(self) -> dict[str, Any]:
        pol = self.core.policy
        out: dict[str, Any] = {"name": pol.name}
        if hasattr(pol, "queue_lengths"):
            out.update(queue_lengths=pol.queue_lengths(), demotions=pol.num_demotions,
                       promotions=pol.num_promotions, quanta=pol.quanta)
        return out

    async def _report_loop(self) -> None:
        while True:
            try:
                snap = self._snapshot()
                self.metrics.update(snap)
                if self.scheduler is not None:
                    # list() copies the dict under the GIL; the loop thread
                    # may add or drop jobs meanwhile.
                    jobs = list(self.core.jobs.values())
                    queued = sum(j.max_total_tokens - j.num_computed_tokens for j in jobs)
                    await self.scheduler.report_load.remote(
                        self.replica_id, snap["num_blocks"], snap["free_blocks"], queued,
                        len(jobs))
            except Exception:  # the scheduler may be restarting; keep serving
                log.exception("load report failed")
            await asyncio.sleep(REPORT_INTERVAL_S)

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
