"""An engine replica's cost model at start (deployments/engine.py): timed
on its model, or pinned by `iteration_cost` without running anything."""

from __future__ import annotations

import pytest

from api.config import AppConfig
from deployments.engine import _start_costs
from tests.engine.test_profiler import ScriptedRunner

PIN = {"base_s": 0.05, "prefill_per_token_s": 0.002, "decode_per_seq_s": 0.001,
       "decode_base_s": 0.04}


def test_a_pinned_cost_runs_no_iteration() -> None:
    runner = ScriptedRunner(slow=set())
    cfg = AppConfig(iteration_cost=PIN, max_batch_size=8)
    cost, tokens_per_s = _start_costs(runner, cfg, cfg.scheduler_config(), needs_cost=True)
    assert runner.calls == 0
    assert (cost.base_s, cost.decode_base_s) == (0.05, 0.04)
    # Admission's start speed: the pinned model's full batch.
    assert tokens_per_s == pytest.approx(8 / (0.04 + 8 * 0.001))


@pytest.mark.parametrize("needs_cost", [True, False])
def test_without_a_pin_the_replica_times_its_model(needs_cost: bool) -> None:
    runner = ScriptedRunner(slow=set())
    cfg = AppConfig(max_batch_size=8, block_size=4)  # the scripted engine's blocks
    cost, tokens_per_s = _start_costs(runner, cfg, cfg.scheduler_config(), needs_cost)
    assert runner.calls > 0
    # The scripted runner's decode at batch 8: 0.1 s + 8 x 2 ms.
    assert tokens_per_s == pytest.approx(8 / 0.116)
    if needs_cost:
        assert cost.decode_time(8) == pytest.approx(0.116)
        assert cost.prefill_time(256) == pytest.approx(0.868)
    else:
        assert cost is None
