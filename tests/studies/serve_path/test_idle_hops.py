"""`studies/serve_path/idle_hops.py`: a request's time split by the engine's trace."""

from __future__ import annotations

import pytest

from studies.serve_path.idle_hops import split


def _plan(t: float, jobs: list[str], iteration: float) -> dict:
    return {"t": t, "jobs": jobs, "iteration_time": iteration}


def test_each_request_is_split_at_its_arrival_and_its_plan():
    sent = [("proxy", 16, 10.000, 10.045), ("direct", 16, 11.000, 11.040),
            ("proxy", 16, 12.000, 12.047)]
    trace = {
        "arrivals": [[12.010, "c"], [10.010, "a"], [11.005, "b"]],
        "trace": [_plan(10.0103, ["a"], 0.030), _plan(11.0053, ["b"], 0.031),
                  _plan(12.0103, ["c"], 0.029),
                  _plan(12.040, ["c"], 0.015)],  # a later plan of the same job: not its first
    }
    out = split(sent, trace)
    a = out["direct"]["16"]
    assert a["requests"] == 1
    assert a["to_engine"] == pytest.approx(5.0)
    assert a["arrival_to_plan"] == pytest.approx(0.3)
    assert a["iteration"] == pytest.approx(31.0)
    assert a["back"] == pytest.approx(40.0 - 5.3 - 31.0)
    assert a["total"] == pytest.approx(40.0)
    p = out["proxy"]["16"]
    assert p["requests"] == 2
    assert p["to_engine"] == pytest.approx(10.0)
    assert p["iteration"] == pytest.approx(29.5)  # the median of 30 and 29
    assert p["total"] == pytest.approx(46.0) and p["total_min"] == pytest.approx(45.0)


def test_a_request_without_exactly_one_arrival_in_its_time_is_left_out():
    sent = [("proxy", 16, 0.0, 0.05), ("proxy", 16, 1.0, 1.05)]
    trace = {"arrivals": [[0.01, "a"], [0.02, "b"], [2.0, "c"]],
             "trace": [_plan(0.011, ["a"], 0.03), _plan(0.021, ["b"], 0.02)]}
    assert split(sent, trace) == {}
