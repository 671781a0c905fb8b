"""The Engine deployment's Serve autoscaling policy: the replicas' own load
reports (`Engine.record_autoscaling_stats`, which Serve collects and
averages over its look-back window) through `scheduler.autoscale`.

Named in the Engine's `autoscaling_config` as
`deployments.autoscaling:EnginePolicy` with the `autoscaling` settings as
its keyword arguments (app/builder.py); Serve creates it once and calls it
every autoscaling tick, and bounds its answer by min/max replicas.
"""

from __future__ import annotations

import time
from typing import Any

from scheduler.autoscale import AutoscaleSettings, ReplicaSignals, desired_replicas


class EnginePolicy:
    def __init__(self, **settings: Any) -> None:
        self.settings = AutoscaleSettings(**settings)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        per_metric: dict[str, dict[Any, float]] = ctx.aggregated_metrics or {}
        by_replica: dict[str, dict[str, float]] = {}
        for name, values in per_metric.items():
            for replica, value in values.items():
                by_replica.setdefault(str(replica), {})[name] = value
        running = {str(r) for r in ctx.running_replicas}
        # A replica still starting reports nothing: it is capacity to come.
        signals = {r: ReplicaSignals.of(m) for r, m in by_replica.items()
                   if r in running and "ttft_ratio" in m}
        now = ctx.current_time if ctx.current_time is not None else time.time()
        return desired_replicas(signals, ctx.target_num_replicas, self.settings,
                                ctx.policy_state or {}, now)
