"""How many engine replicas an application wants, from the replicas' own
load reports (the policy behind Serve's autoscaler; deployments/autoscaling.py
feeds it).

Serve's default autoscaler counts ongoing requests; an engine's requests
come through the Scheduler deployment and a count says nothing of how long
they are, so the engines report what admission already measures:

- `ttft_ratio`: a typical newcomer's estimated TTFT on the replica (its
  queued prefill, decodes and measured iteration speed; scheduler/admission.py)
  over the TTFT objective: near 1 the replica is about to miss online SLOs;
- `tpot_ratio`: how far its recent iterations decoding online jobs (the
  time between a running online job's tokens; `online_cadence`) have moved
  from a lone decode's time towards the TPOT objective: 0 idle or decoding
  alone, 1 at the objective.  Under
  MLFQ a newcomer's prefill jumps the queue, so a busy replica keeps its
  TTFT and lets every running job's TPOT stretch instead
  (studies/autoscale/README.md): TTFT alone would not see that load;
- `kv_use`: the share of its device KV blocks in use;
- `online_jobs`, `offline_jobs`: what it holds of each class.

The load is the larger of the two ratios, each averaged over the replicas;
both grow about linearly with the work a replica holds.  Scale up as soon as
the load reaches `upscale_at` (or KV use passes `kv_high` with online work
queued), for `upscale_delay_s`: to as many replicas as bring the load back
to `upscale_at` if it spread evenly.  Scale down, one replica at a time,
when the online load would still sit under `downscale_at` on one replica
fewer, for `downscale_delay_s`: offline work never holds a replica up,
since the replicas left absorb it in the capacity chat leaves idle.  A
replica that has not reported yet (still loading its model and profiling)
counts as capacity to come, not as load: the load is spread over it too,
and a load still at `upscale_at` with it counted asks for more at once,
without waiting for it to report (a burst's queue keeps growing while
replicas start; waiting for each before asking for the next halved the
SLO attainment of a simulated burst at paper scale,
studies/autoscale_sim/README.md).  Serve bounds the result by
`min_replicas` / `max_replicas`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scheduler.admission import PrefillLoad, ttft_estimate
from scheduler.cost import CostEstimator
from scheduler.job import Job, JobClass
from scheduler.plan import Plan

# An enum member's lookup costs ~0.15 µs on Python 3.11: once per job or chunk.
_ONLINE = JobClass.ONLINE


class AutoscaleSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Off: `num_engine_replicas` replicas, always.
    enabled: bool = False
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1)
    # Share of the TTFT objective a typical newcomer's estimate may reach,
    # on average over the replicas, before another replica is asked for.
    upscale_at: float = Field(0.5, gt=0, le=1)
    # ... and below which (on one replica fewer) one is let go.
    downscale_at: float = Field(0.2, ge=0, lt=1)
    # KV use that asks for another replica while online work is queued.
    kv_high: float = Field(0.9, gt=0, le=1)
    # A typical newcomer's prompt, for the estimate.
    typical_prompt_tokens: int = Field(256, ge=1)
    # The online TPOT objective of `tpot_ratio`.  None: 3x the replica's
    # start-up estimate of a lone decode (ConServe's default, §6.1).
    tpot_slo_s: float | None = Field(None, gt=0)
    # Seconds of decode iterations that `tpot_ratio` averages.
    tpot_window_s: float = Field(5.0, gt=0)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> "AutoscaleSettings":
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be >= min_replicas")
        if self.downscale_at >= self.upscale_at:
            raise ValueError("downscale_at must be below upscale_at")
        return self


@dataclass(frozen=True, slots=True)
class ReplicaSignals:
    ttft_ratio: float
    kv_use: float
    online_jobs: int
    offline_jobs: int
    tpot_ratio: float = 0.0

    @classmethod
    def of(cls, metrics: Mapping[str, float]) -> "ReplicaSignals":
        return cls(float(metrics.get("ttft_ratio", 0.0)), float(metrics.get("kv_use", 0.0)),
                   int(metrics.get("online_jobs", 0)), int(metrics.get("offline_jobs", 0)),
                   float(metrics.get("tpot_ratio", 0.0)))


def desired_replicas(signals: Mapping[str, ReplicaSignals], current: int,
                     settings: AutoscaleSettings, state: dict[str, Any],
                     now: float) -> tuple[int, dict[str, Any]]:
    """(replicas wanted, the state to pass back next time).  `signals`: the
    replicas that have reported; `current`: the replicas Serve runs or is
    starting."""
    state = dict(state)
    if not signals:
        state.pop("hot_since", None)
        state.pop("cold_since", None)
        return current, state
    reported = len(signals)
    # Load as if it spread over every replica, those still starting too.
    spread = max(current, reported)
    ratio = max(sum(s.ttft_ratio for s in signals.values()),
                sum(s.tpot_ratio for s in signals.values())) / spread
    online = sum(s.online_jobs for s in signals.values())
    crowded = online > 0 and max(s.kv_use for s in signals.values()) >= settings.kv_high
    if ratio >= settings.upscale_at or crowded:
        state.pop("cold_since", None)
        since = state.setdefault("hot_since", now)
        if now - since < settings.upscale_delay_s:
            return current, state  # not for long yet
        state.pop("hot_since")
        wanted = math.ceil(spread * ratio / settings.upscale_at - 1e-9)
        if reported < current:  # help on its way: only what its share leaves
            return max(current, wanted), state
        return max(current + 1, wanted), state
    state.pop("hot_since", None)
    fewer = current - 1
    if fewer >= 1 and ratio * current / fewer < settings.downscale_at \
            and not any(s.kv_use >= settings.kv_high and s.online_jobs for s in signals.values()):
        since = state.setdefault("cold_since", now)
        if now - since >= settings.downscale_delay_s:
            state["cold_since"] = now  # the next one after another delay
            return fewer, state
        return current, state
    state.pop("cold_since", None)
    return current, state


def kv_use(jobs: Iterable[Job], free_blocks: int, num_blocks: int, policy: str) -> float:
    """The share of device KV blocks in use; under `policy: conserve`, held
    by online jobs only: offline jobs give theirs up to online work
    (ConServe §4.3), so a batch backlog filling the cache, as co-serving
    lets it, is no reason for another replica."""
    if policy != "conserve":
        return 1.0 - free_blocks / max(1, num_blocks)
    held = sum(len(j.block_table) for j in jobs if j.job_class is _ONLINE)
    return min(1.0, held / max(1, num_blocks))


def online_cadence(plan: Plan, jobs: Mapping[str, Job],
                   cost: CostEstimator | None = None) -> tuple[bool, bool, float]:
    """(whether an iteration decodes an online job, whether the replica
    holds one, the online jobs' share of its estimated time): the first
    make the cadence `tpot_ratio` reads; iterations between them lengthen
    its gaps while online jobs are held, and with none the cadence ends.
    Offline jobs have no TPOT objective: a batch job running alone, whose
    large batches make slow iterations, must not ask for replicas, nor must
    the offline tokens co-serving adds to online iterations up to the TPOT
    objective by design (ConServe §4.5), so a gap counts at the online
    share of its iteration (1 without a cost estimate)."""
    d_on = p_on = d_all = p_all = 0
    for c in plan.chunks:
        j = jobs.get(c.job_id)
        online = j is not None and j.job_class is _ONLINE
        if c.is_decode:
            d_all += 1
            d_on += online
        else:
            p_all += c.num_tokens
            p_on += c.num_tokens if online else 0
    held = d_on > 0 or any(j.job_class is _ONLINE for j in jobs.values())
    share = 1.0
    if cost is not None and (d_on, p_on) != (d_all, p_all):
        whole = cost.batch_time(d_all, 0, p_all, 0)
        share = min(1.0, cost.batch_time(d_on, 0, p_on, 0) / whole) if whole > 0 else 1.0
    return d_on > 0, held, share


def tpot_ratio(decode_gaps: list[float], lone_decode_s: float, tpot_slo_s: float) -> float:
    """Where the mean of recent decode iterations' seconds lies between a
    lone decode's (0) and the TPOT objective (1); 0 with none."""
    if not decode_gaps:
        return 0.0
    gap = sum(decode_gaps) / len(decode_gaps)
    span = tpot_slo_s - lone_decode_s
    if span <= 0:  # an objective no decode can meet: any decoding is load
        return gap / tpot_slo_s
    return max(0.0, (gap - lone_decode_s) / span)


def replica_signals(report: Mapping[str, Any], kv_use: float, online_jobs: int,
                    offline_jobs: int, typical_prompt_tokens: int,
                    tpot: float = 0.0) -> dict[str, float]:
    """An engine replica's autoscaling metrics from its admission figures
    (`scheduler.admission.load_report`): the TTFT estimate of a typical
    newcomer over the objective, or, where the replica bounds queued tokens
    instead, its queued work over that bound; `tpot` is its `tpot_ratio`."""
    prefill, slo = report.get("prefill"), report.get("ttft_slo_s")
    if prefill is not None and slo:
        ratio = ttft_estimate(PrefillLoad(**prefill), typical_prompt_tokens) / slo
    else:
        capacity = report.get("capacity_tokens") or math.inf
        ratio = 0.0 if math.isinf(capacity) else report.get("waiting_tokens", 0) / capacity
    return {"ttft_ratio": ratio, "tpot_ratio": tpot, "kv_use": kv_use,
            "online_jobs": float(online_jobs), "offline_jobs": float(offline_jobs)}
