"""The Engine deployment's Serve autoscaling policy reads Serve's context:
per-metric, per-replica averages of what the replicas recorded."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from deployments.autoscaling import EnginePolicy


def ctx(metrics: dict[str, dict[str, float]], running: list[str], target: int,
        now: float, state: dict[str, Any] | None = None) -> SimpleNamespace:
    return SimpleNamespace(aggregated_metrics=metrics, running_replicas=running,
                           target_num_replicas=target, current_time=now,
                           policy_state=state or {})


def test_the_policy_turns_serves_metrics_into_replicas() -> None:
    policy = EnginePolicy(enabled=True, max_replicas=4, upscale_delay_s=2)
    hot = {"ttft_ratio": {"r1": 1.0}, "kv_use": {"r1": 0.4}, "online_jobs": {"r1": 8},
           "offline_jobs": {"r1": 0}}
    wanted, state = policy(ctx(hot, ["r1"], 1, 0.0))
    assert wanted == 1 and state["hot_since"] == 0.0
    wanted, state = policy(ctx(hot, ["r1"], 1, 2.0, state))
    assert wanted == 2  # 1.0 / 0.5
    # A replica Serve no longer runs is ignored; one that has not recorded
    # anything yet is capacity to come.
    stale = {k: {**v, "gone": 9.0} for k, v in hot.items()}
    wanted, _ = policy(ctx(stale, ["r1", "r2"], 2, 10.0, {"hot_since": 0.0}))
    assert wanted == 2
    assert policy(ctx({}, [], 1, 0.0)) == (1, {})
