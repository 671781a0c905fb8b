"""Engine autoscaling live: Serve calls the application's policy
(deployments/autoscaling.py) with the metrics the engine replicas record,
and starts the replica it asks for.  The objective is set so low that an
idle replica's own estimate already asks for a second one."""

from __future__ import annotations

import time

import pytest

from tests.integration.conftest import SMALL_CONFIG, _deploy, _engine_handle

# In the long run (-m slow): two replica starts, forty seconds of a default
# run that must stay short.  The default run keeps the policy
# (tests/deployments/test_autoscaling_policy.py), the engine's reports
# (test_engine_loop_costs.py) and the scaling simulated
# (tests/bench/test_cluster_sim.py).
pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCALE_CONFIG = {
    **SMALL_CONFIG,
    "engine_num_cpus": 0.25,
    "num_threads": 1,
    "autoscaling": {"enabled": True, "min_replicas": 1, "max_replicas": 2,
                    "upscale_at": 0.0002, "downscale_at": 0.0001, "upscale_delay_s": 0},
}


def _engine_replicas(app: str) -> int:
    from ray import serve

    status = serve.status().applications[app].deployments["Engine"]
    return status.replica_states.get("RUNNING", 0)


def test_the_policy_reads_the_engines_reports_and_scales_up(server):
    from ray import serve

    _deploy(server, "scale", SCALE_CONFIG)
    try:
        stats = _engine_handle("scale").record_autoscaling_stats.remote().result()
        assert set(stats) == {"ttft_ratio", "tpot_ratio", "kv_use", "online_jobs",
                              "offline_jobs"}
        # Idle: no decode iterations, so no TPOT load.
        assert stats["ttft_ratio"] > 0.0002 and stats["kv_use"] == 0.0
        assert stats["tpot_ratio"] == 0.0
        deadline = time.monotonic() + 120
        while _engine_replicas("scale") < 2:
            assert time.monotonic() < deadline, serve.status().applications["scale"]
            time.sleep(1)
    finally:
        serve.delete("scale")
