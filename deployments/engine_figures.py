"""The figures an engine replica reports: its stats (`Engine.stats`, the
Ray dashboard's source, deployments/engine_metrics.py), its load for the
Scheduler deployment's admission control and offline pool, and its
autoscaling signals (`record_autoscaling_stats`, which Serve calls)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from api.config import AppConfig
from deployments.engine_loop import EngineLoop
from scheduler.admission import AdmissionBound, bounded, load_report
from scheduler.autoscale import kv_use, replica_signals, tpot_ratio
from scheduler.checkpoint import exposure
from scheduler.core import SchedulerCore
from scheduler.cost import LinearCost
from scheduler.cost_fit import COEFFICIENTS, LiveCost
from scheduler.job import JobClass
from scheduler.offline_pool import offline_load


class EngineFigures:
    """Mixed into the `Engine` deployment, which sets these attributes."""

    cfg: AppConfig
    core: SchedulerCore
    loop: EngineLoop
    runner: Any
    kv_tier: Any
    replica_id: str
    head_source: str | None
    bound: AdmissionBound
    cost: LinearCost | None
    live_cost: LiveCost | None
    ttft_admission: bool
    start_tokens_per_s: float | None
    offline_accepted: int
    _streams: dict[str, Any]
    _last_admission: tuple[float, dict[str, Any]]

    def _snapshot(self) -> dict[str, Any]:
        s = self.core.stats()
        ls = self.loop.stats
        # list() copies the dict under the GIL; the loop thread may add or
        # drop jobs meanwhile.
        jobs = list(self.core.jobs.values())
        return {
            "replica": self.replica_id,
            "length_head": self.head_source,
            "num_waiting": s.num_waiting,
            "num_running": s.num_running,
            "free_blocks": s.num_free_blocks,
            "num_blocks": s.num_blocks,
            "num_preemptions": s.num_preemptions,
            "num_finished": s.num_finished,
            "num_aborted": s.num_aborted,
            "shared_prompt_tokens": s.num_shared_prompt_tokens,
            "prefix_cache": {"queried_tokens": s.num_prefix_queried_tokens,
                             "hit_tokens": s.num_prefix_hit_tokens,
                             "cached_blocks": s.num_cached_blocks},
            "admission": self._admission_figures(jobs),
            "offline": self._offline_figures(jobs, s.num_free_blocks),
            "iterations": ls.iterations,
            "forward_time": ls.forward_time,
            "loop_time": ls.loop_time,
            "plan_time": ls.plan_time,
            "complete_time": ls.complete_time,
            "tokens_out": ls.tokens_out,
            "speculative": {"drafted": ls.drafted, "accepted": ls.accepted},
            "interrupted_passes": ls.interrupted,
            "tokens_by_class": dict(ls.tokens_by_class),
            "resumed": {"jobs": ls.resumed_jobs,
                        "tokens_recomputed": ls.resumed_tokens - ls.resumed_kv_tokens,
                        "tokens_fetched": ls.resumed_kv_tokens},
            "preemptions_by_class": dict(ls.preemptions_by_class),
            # Unstarted offline requests given back to the offline pool.
            "offline_given_back": self.loop.num_given_back,
            "recent_forward_s": list(ls.recent_forward),
            "open_streams": len(self._streams),
            "swap": {
                "swap_outs": self.core.swap.num_swap_out,
                "swap_ins": self.core.swap.num_swap_in,
                "blocks_out": self.core.swap.blocks_out,
                "blocks_in": self.core.swap.blocks_in,
                # Swap-in blocks still on the device (prefix cache): not copied.
                "blocks_kept": self.core.swap.blocks_kept,
                "recompute_fallbacks": self.core.swap.num_recompute_fallbacks,
                "host_used_blocks": self.core.swap.host_used,
                "checkpoint_blocks": self.core.swap.blocks_checkpointed,
                "checkpoint_discards": self.core.swap.num_checkpoint_discards,
                "tokens_discarded": self.core.swap.tokens_discarded,
                # The host tier's copies: stores, fetches, their seconds, the
                # blocks fetched before their store ended, stores skipped.
                "tier": asdict(self.kv_tier.stats) if self.kv_tier is not None else None,
            },
            "survival": self._survival_figures(jobs),
            "policy": self._policy_stats(),
            "engine": {
                "dtype": str(self.runner.dtype).removeprefix("torch."),
                "attention_backend": self.runner.attn.name,
                "kv_layout": self.runner.attn.kv_layout,
                "packed_projections": self.runner.model.packing,
                "weight_codes": self.runner.model.weight_codes(),
                "deterministic": self.runner.deterministic,
                "packing_speedup": self.runner.packing_speedup,
                # The cost model in use, as `iteration_cost` pins it, and
                # where it came from (None: nothing here reads one, none timed).
                "iteration_cost": None if self.cost is None else asdict(self.cost),
                "iteration_cost_source": None if self.cost is None
                else "config" if self.cfg.iteration_cost else "timed",
                "start_tokens_per_s": self.start_tokens_per_s,
            },
        }

    def _survival_figures(self, jobs: list[Any]) -> dict[str, int]:
        """What this replica's death now would make others recompute: its
        resident jobs' tokens past their last checkpoint (all their tokens
        without `survival.checkpoint`), and the host copies still queued."""
        ex = exposure(jobs, self.core.config.block_size)
        return {"resident_jobs": ex.jobs, "uncovered_tokens": ex.tokens,
                "max_uncovered_tokens": ex.largest,
                "tier_pending_blocks": self.kv_tier.pending_blocks if self.kv_tier else 0}

    def _admission_figures(self, jobs: list[Any]) -> dict[str, Any]:
        jobs = [j for j in jobs if bounded(j.job_class.value, self.cfg.policy)]
        mean_out = self.loop.mean_output.value
        tps = self.loop.stats.full_batch_tokens_per_s or self.start_tokens_per_s or None
        cfg = self.core.config
        return load_report(jobs, self.core.batch, mean_out, tps, self.bound,
                           cfg.max_batch_size, cfg.max_batch_tokens,
                           self.cost if self.ttft_admission else None,
                           self.loop.stats.prefill_slowdown,
                           self.core.policy.newcomer_levels(self.core.batch, mean_out)
                           if self.bound.max_backlog_s is not None else None)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """This replica's load for Serve's autoscaler (deployments/autoscaling.py,
        scheduler/autoscale.py); Serve calls it every metrics interval."""
        jobs = list(self.core.jobs.values())
        online = sum(1 for j in jobs if j.job_class is JobClass.ONLINE)
        kv = kv_use(jobs, self.core.blocks.num_free, self.core.config.num_blocks,
                    self.cfg.policy)
        scale = self.cfg.autoscaling
        at, figures = self._last_admission
        if time.monotonic() - at > 1.0:  # the reporter's are older than a tick
            figures = self._admission_figures(jobs)
        tpot = 0.0
        if self.cost is not None:
            since = time.monotonic() - scale.tpot_window_s
            gaps = [g for t, g in list(self.loop.stats.decode_gaps) if t >= since]
            lone = self.cost.decode_time(1)
            tpot = tpot_ratio(gaps, lone, scale.tpot_slo_s or 3 * lone)
        return replica_signals(figures, kv, online, len(jobs) - online,
                               scale.typical_prompt_tokens, tpot)

    def _offline_figures(self, jobs: list[Any], free_blocks: int) -> dict[str, int]:
        """What the Scheduler's offline pool hands work by
        (scheduler/offline_pool.py), counting the offline requests still in
        the loop's inbox."""
        inbox = list(self.loop.inbox_offline.values())
        cfg = self.cfg
        return offline_load(
            jobs, self.core.batch, self.loop.mean_output.value,
            batch_limit=cfg.conserve.offline_max_batch_size or cfg.max_batch_size,
            free_blocks=free_blocks, block_size=cfg.block_size,
            inbox_jobs=sum(n for n, _ in inbox), inbox_tokens=sum(t for _, t in inbox),
            accepted=self.offline_accepted, started=self.loop.stats.offline_started,
        ).to_wire()

    def _policy_stats(self) -> dict[str, Any]:
        pol = self.core.policy
        out: dict[str, Any] = {"name": pol.name}
        if hasattr(pol, "counters"):  # econoserve
            out.update(pol.counters())
        if hasattr(pol, "queue_lengths"):
            out.update(queue_lengths=pol.queue_lengths(), demotions=pol.num_demotions,
                       promotions=pol.num_promotions, quanta=pol.quanta)
        if hasattr(pol, "coserving"):
            out.update(coserving=pol.coserving, offline_paused=pol.offline_paused)
        if self.live_cost is not None:
            out.update(cost_fit=dict(zip(COEFFICIENTS, self.live_cost.coefficients)),
                       cost_fit_samples=self.live_cost.samples)
        return out
