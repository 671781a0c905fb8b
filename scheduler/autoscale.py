"""How many engine replicas an application wants, from the replicas' own
load reports (the policy behind Serve's autoscaler; deployments/autoscaling.py
feeds it).

Serve's default autoscaler counts ongoing requests; an engine's requests
come through the Scheduler deployment and a count says nothing of how long
they are, so the engines report what admission already measures:

- `ttft_ratio`: a typical newcomer's estimated TTFT on the replica (its
  queued prefill, decodes and measured iteration speed; scheduler/admission.py)
  over the TTFT objective: near 1 the replica is about to miss online SLOs;
- `kv_use`: the share of its device KV blocks in use;
- `online_jobs`, `offline_jobs`: what it holds of each class.

Scale up as soon as the replicas, on average, have used `upscale_at` of the
TTFT objective (or KV use passes `kv_high` with online work queued), for
`upscale_delay_s`: to as many replicas as bring that average back to
`upscale_at` if load spread evenly.  Scale down, one replica at a time,
when the online load would still sit under `downscale_at` on one replica
fewer, for `downscale_delay_s`: offline work never holds a replica up,
since the replicas left absorb it in the capacity chat leaves idle.  A
replica that has not reported yet (still loading its model and profiling)
counts as capacity to come, not as load.  Serve bounds the result by
`min_replicas` / `max_replicas`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


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

    @classmethod
    def of(cls, metrics: Mapping[str, float]) -> "ReplicaSignals":
        return cls(float(metrics.get("ttft_ratio", 0.0)), float(metrics.get("kv_use", 0.0)),
                   int(metrics.get("online_jobs", 0)), int(metrics.get("offline_jobs", 0)))


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
    ratio = sum(s.ttft_ratio for s in signals.values()) / max(current, reported)
    online = sum(s.online_jobs for s in signals.values())
    crowded = online > 0 and max(s.kv_use for s in signals.values()) >= settings.kv_high
    if ratio >= settings.upscale_at or crowded:
        state.pop("cold_since", None)
        since = state.setdefault("hot_since", now)
        if now - since < settings.upscale_delay_s or reported < current:
            return current, state  # not for long yet, or help is on its way
        state.pop("hot_since")
        wanted = math.ceil(max(current, reported) * ratio / settings.upscale_at)
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


def replica_signals(report: Mapping[str, Any], kv_use: float, online_jobs: int,
                    offline_jobs: int, typical_prompt_tokens: int) -> dict[str, float]:
    """An engine replica's autoscaling metrics from its admission figures
    (`scheduler.admission.load_report`): the TTFT estimate of a typical
    newcomer over the objective, or, where the replica bounds queued tokens
    instead, its queued work over that bound."""
    from scheduler.admission import PrefillLoad, ttft_estimate

    prefill, slo = report.get("prefill"), report.get("ttft_slo_s")
    if prefill is not None and slo:
        ratio = ttft_estimate(PrefillLoad(**prefill), typical_prompt_tokens) / slo
    else:
        capacity = report.get("capacity_tokens") or math.inf
        ratio = 0.0 if math.isinf(capacity) else report.get("waiting_tokens", 0) / capacity
    return {"ttft_ratio": ratio, "kv_use": kv_use, "online_jobs": float(online_jobs),
            "offline_jobs": float(offline_jobs)}
