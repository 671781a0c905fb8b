"""`studies/burst/path_cpu.py`'s intake figures from a live trace."""

from __future__ import annotations

import pytest

from studies.burst.path_cpu import intake


def _plan(t: float, jobs: list[str]) -> dict:
    return {"t": t, "jobs": jobs, "tokens": 16 * len(jobs)}


def test_the_intake_comes_from_arrivals_and_each_choice_waits_from_its_requests():
    started = 100.0
    trace = {
        # An arrival of an earlier run (before `started`) is not counted.
        "arrivals": [[99.0, "old"], [100.5, "a"], [100.7, "b"], [101.5, "c"]],
        "trace": [_plan(99.2, ["old"]), _plan(100.6, ["a"]),
                  # b's second choice is planned with b.
                  _plan(101.0, ["a", "b", "b#1"]), _plan(102.0, ["a", "b", "b#1", "c"])],
    }
    got = intake(trace, started)
    assert got["intake_s"] == pytest.approx(1.0)  # 100.5 to 101.5
    assert got["first_arrival_after_start_s"] == pytest.approx(0.5)
    assert got["requests_arrived"] == 3 and got["jobs_planned"] == 4
    # Waits: a 0.1, b 0.3, b#1 0.3, c 0.5.
    assert got["arrival_to_first_plan_median_s"] == pytest.approx(0.3)
    # The plans alone: first plan 100.6 to c's first plan 102.0.
    assert got["intake_from_plans_s"] == pytest.approx(1.4)
