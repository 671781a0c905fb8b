"""An engine replica's figures in the Ray dashboard (ray.util.metrics).

Updated from the replica's own totals a few times a second, never from the
iteration loop: counters advance by the difference since the last update.
"""

from __future__ import annotations

from typing import Any

from ray.util import metrics

from deployments.job_metrics import FinishedJob

_GAUGES = {
    "num_running": ("engine_running_jobs", "Jobs in the running batch"),
    "num_waiting": ("engine_waiting_jobs", "Jobs waiting, preempted or swapped"),
    "kv_utilization": ("engine_kv_utilization", "Share of device KV blocks in use"),
    "host_used_blocks": ("engine_host_kv_blocks", "KV blocks held in the host tier"),
    "uncovered_tokens": ("engine_survival_uncovered_tokens",
                         "Computed tokens of resident jobs past their last checkpoint: "
                         "recomputed elsewhere if the replica died now"),
    "tier_pending_blocks": ("engine_kv_tier_pending_blocks",
                            "KV blocks queued for the host tier and not stored yet"),
    "cached_blocks": ("engine_prefix_cache_blocks",
                      "Device KV blocks no job holds, kept by the prefix cache"),
}
_COUNTERS = {
    "num_preemptions": ("engine_preemptions", "Jobs preempted"),
    "tokens_out": ("engine_generated_tokens", "Tokens generated"),
    "blocks_out": ("engine_swap_out_blocks", "KV blocks swapped out to the host tier"),
    "blocks_in": ("engine_swap_in_blocks", "KV blocks swapped back in"),
    "blocks_kept": ("engine_swap_kept_blocks",
                    "KV blocks of swap-ins found still on the device, not copied back"),
    "recompute_fallbacks": ("engine_recompute_fallbacks",
                            "Preemptions that recomputed because the host tier was full"),
    "checkpoint_blocks": ("engine_checkpoint_blocks",
                          "KV blocks checkpointed to the host tier (ConServe)"),
    "checkpoint_discards": ("engine_checkpoint_discards",
                            "Preemptions back to a checkpoint, with no copy"),
    "tokens_discarded": ("engine_checkpoint_discarded_tokens",
                         "Computed tokens past a checkpoint given up by preemptions"),
    "prefix_queried_tokens": ("engine_prefix_cache_queried_tokens",
                              "Tokens of admitted jobs looked up in the prefix cache"),
    "prefix_hit_tokens": ("engine_prefix_cache_hit_tokens",
                          "Tokens whose KV admitted jobs found in the prefix cache"),
    "drafted": ("engine_spec_drafted_tokens", "Draft tokens verified (speculative decoding)"),
    "accepted": ("engine_spec_accepted_tokens",
                 "Draft tokens accepted (speculative decoding)"),
    "demotions": ("engine_mlfq_demotions", "MLFQ demotions"),
    "promotions": ("engine_mlfq_promotions", "MLFQ starvation promotions"),
    "econoserve_gts_admitted": ("engine_econoserve_gts_admitted",
                                "Generation tasks admitted to the batch (EconoServe)"),
    "econoserve_overruns": ("engine_econoserve_overruns",
                            "Generation tasks that reached their KV allocation unfinished"),
    "econoserve_paused": ("engine_econoserve_paused",
                          "Preemptions of generation tasks past their allocation (pause_kv)"),
}


# Seconds; the dashboard's percentiles interpolate within these buckets.
_TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300]
_TPOT_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5]
_E2E_BUCKETS = [0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800]


class EngineMetrics:
    def __init__(self, replica: str) -> None:
        tags = {"replica": replica}
        self.gauges = {k: metrics.Gauge(n, d, tag_keys=("replica",)) for k, (n, d) in _GAUGES.items()}
        self.counters = {k: metrics.Counter(n, d, tag_keys=("replica",)) for k, (n, d) in _COUNTERS.items()}
        self.queues = metrics.Gauge("engine_mlfq_queue_length", "Jobs per MLFQ queue",
                                    tag_keys=("replica", "queue"))
        # Per job class (online / offline: ConServe co-serving).
        by_class = ("replica", "job_class")
        self.class_tokens = metrics.Counter(
            "engine_class_generated_tokens", "Tokens generated, by job class", tag_keys=by_class)
        self.class_preemptions = metrics.Counter(
            "engine_class_preemptions", "Jobs preempted, by job class", tag_keys=by_class)
        self.ttft = metrics.Histogram("engine_ttft_seconds", "Time to first token of finished "
                                      "jobs, by job class", _TTFT_BUCKETS, tag_keys=by_class)
        self.tpot = metrics.Histogram("engine_tpot_seconds", "Time per output token after the "
                                      "first, of finished jobs, by job class", _TPOT_BUCKETS,
                                      tag_keys=by_class)
        self.e2e = metrics.Histogram("engine_e2e_seconds", "Arrival at the replica to the last "
                                     "token, of finished jobs, by job class", _E2E_BUCKETS,
                                     tag_keys=by_class)
        self.queue_time = metrics.Histogram(
            "engine_queue_seconds", "Arrival at the replica to the first iteration, of finished "
            "jobs, by job class", _TTFT_BUCKETS, tag_keys=by_class)
        self.finished = metrics.Counter(
            "engine_finished_jobs", "Jobs finished, by job class and finish reason (stop, "
            "length, abort: the client went away)",
            tag_keys=(*by_class, "finish_reason"))
        self.prompt_tokens = metrics.Counter(
            "engine_finished_prompt_tokens", "Prompt tokens of finished jobs, by job class",
            tag_keys=by_class)
        for m in (*self.gauges.values(), *self.counters.values(), self.queues, self.class_tokens,
                  self.class_preemptions, self.ttft, self.tpot, self.e2e, self.queue_time,
                  self.finished, self.prompt_tokens):
            m.set_default_tags(tags)
        self._last: dict[str, float] = {}

    def observe(self, finished: list[FinishedJob]) -> None:
        """Finished jobs, handed over by the iteration loop."""
        for job in finished:
            tags = {"job_class": job.job_class}
            self.finished.inc(1, tags={**tags, "finish_reason": job.finish_reason})
            if job.prompt_tokens:
                self.prompt_tokens.inc(job.prompt_tokens, tags=tags)
            self.e2e.observe(job.e2e, tags=tags)
            self.queue_time.observe(job.queue_time, tags=tags)
            if job.ttft is not None:
                self.ttft.observe(job.ttft, tags=tags)
            if job.tpot is not None:
                self.tpot.observe(job.tpot, tags=tags)

    def update(self, snapshot: dict[str, Any]) -> None:
        """From `Engine.stats()`'s snapshot, the one source of these figures."""
        swap, policy = snapshot["swap"], snapshot["policy"]
        prefix = snapshot.get("prefix_cache") or {}
        survival = snapshot.get("survival") or {}
        spec = snapshot.get("speculative") or {}
        figures = {
            "num_running": snapshot["num_running"],
            "num_waiting": snapshot["num_waiting"],
            "kv_utilization": 1 - snapshot["free_blocks"] / snapshot["num_blocks"],
            "host_used_blocks": swap["host_used_blocks"],
            "uncovered_tokens": survival.get("uncovered_tokens"),
            "tier_pending_blocks": survival.get("tier_pending_blocks"),
            "num_preemptions": snapshot["num_preemptions"],
            "tokens_out": snapshot["tokens_out"],
            "blocks_out": swap["blocks_out"],
            "blocks_in": swap["blocks_in"],
            "blocks_kept": swap.get("blocks_kept"),
            "recompute_fallbacks": swap["recompute_fallbacks"],
            "checkpoint_blocks": swap.get("checkpoint_blocks"),
            "checkpoint_discards": swap.get("checkpoint_discards"),
            "tokens_discarded": swap.get("tokens_discarded"),
            "cached_blocks": prefix.get("cached_blocks"),
            "prefix_queried_tokens": prefix.get("queried_tokens"),
            "prefix_hit_tokens": prefix.get("hit_tokens"),
            "drafted": spec.get("drafted"),
            "accepted": spec.get("accepted"),
            "demotions": policy.get("demotions"),
            "promotions": policy.get("promotions"),
            **{k: policy.get(k) for k in ("econoserve_gts_admitted", "econoserve_overruns",
                                          "econoserve_paused")},
        }
        for key, gauge in self.gauges.items():
            if figures.get(key) is not None:
                gauge.set(figures[key])
        for key, counter in self.counters.items():
            value = figures.get(key)
            if value is None:
                continue
            delta = value - self._last.get(key, 0)
            if delta > 0:
                counter.inc(delta)
            self._last[key] = value
        for kind, counter in (("tokens_by_class", self.class_tokens),
                              ("preemptions_by_class", self.class_preemptions)):
            for job_class, value in (snapshot.get(kind) or {}).items():
                key = f"{kind}:{job_class}"
                delta = value - self._last.get(key, 0)
                if delta > 0:
                    counter.inc(delta, tags={"job_class": job_class})
                self._last[key] = value
        for i, n in enumerate(policy.get("queue_lengths") or []):
            self.queues.set(n, tags={"queue": str(i + 1)})
