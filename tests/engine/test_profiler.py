"""The replica's start-up cost fit (engine/profiler.py) on a scripted runner."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.profiler import estimate_cost
from scheduler.plan import Plan, StepResult
from tests.scheduler.conftest import FakeClock, FakeEngine


class ScriptedRunner:
    """Iterations cost 0.1 s + 3 ms per prefill token + 2 ms per decoding
    sequence; the iterations listed in `slow` (by call number) take 0.6 s
    longer."""

    def __init__(self, slow: set[int]) -> None:
        self.engine = FakeEngine(FakeClock())
        self.slow = slow
        self.calls = 0

    def add_request(self, *args: object) -> None:
        pass

    def remove_request(self, job_id: str) -> None:
        pass

    def execute(self, plan: Plan) -> StepResult:
        self.calls += 1
        res = self.engine.execute(plan)
        t = 0.1 + sum(0.003 * c.num_tokens if c.num_tokens > 1 else 0.002
                      for c in plan.chunks)
        if self.calls in self.slow:
            t += 0.6
        return replace(res, iteration_time=t)


def test_fit_recovers_the_cost_model():
    cost = estimate_cost(ScriptedRunner(slow=set()), block_size=4)
    assert cost.prefill_time(16) == pytest.approx(0.148)
    assert cost.prefill_time(256) == pytest.approx(0.868)
    assert cost.decode_time(1) == pytest.approx(0.102)
    assert cost.decode_time(8) == pytest.approx(0.116)
    assert cost.batch_time(8, 800, 0, 0) == pytest.approx(0.116)
    assert cost.batch_time(4, 400, 16, 136) == pytest.approx(0.1 + 0.048 + 0.008)


@pytest.mark.parametrize("slow", [{3}, {4, 8}, {9}])
def test_one_busy_moment_does_not_set_the_quanta(slow):
    # Calls 1-2: warm-up; 3: first short prefill; 4-8 its decodes; 9: long.
    cost = estimate_cost(ScriptedRunner(slow=slow), block_size=4)
    assert cost.decode_time(1) == pytest.approx(0.102)
    assert cost.prefill_time(256) == pytest.approx(0.868)
