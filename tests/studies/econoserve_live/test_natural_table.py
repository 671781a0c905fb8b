"""`studies/econoserve_live/natural_table.py`: the figures of a run whose
answers end by themselves."""

from __future__ import annotations

from typing import Any

import pytest

from studies.econoserve_live.natural_table import row


def _rec(arrive: float, end: float, out: int, predicted: int | None) -> dict[str, Any]:
    return {"scheduled_time": arrive, "end_time": end, "output_tokens": out,
            "predicted_output_tokens": predicted, "error": None}


def test_estimates_are_capped_and_the_share_finished_while_arriving_counted() -> None:
    dist = {"mean": 0.02, "p95": 0.04, "p99": 0.05}
    run = {"meta": {"system": "econoserve"},
           "summary": {"num_completed": 4, "request_throughput": 1.0, "num_preemptions": 3,
                       "normalized_latency": dist, "e2e": dist, "ttft": dist, "tpot": dist},
           "records": [_rec(0.0, 1.0, 256, 400),   # capped at 256: exact
                       _rec(1.0, 2.5, 100, 80),    # 80 × 1.15 < 100: under
                       _rec(2.0, 2.5, 50, None),   # no estimate
                       _rec(3.0, 6.0, 10, 20)]}    # ends after the last arrival
    r = row(run, cap=256)
    assert r["finished_while_arriving"] == pytest.approx(3 / 4)
    assert r["capped"] == 1 and r["output_tokens"] == 416
    assert r["estimate_mae"] == pytest.approx((0 + 20 + 10) / 3)
    assert r["estimate_under"] == pytest.approx(1 / 3)
    assert r["mean_nl_ms"] == pytest.approx(20.0) and r["preemptions"] == 3


def test_a_run_without_estimates_has_no_estimate_figures() -> None:
    dist = {"mean": 0.02, "p95": 0.04, "p99": 0.05}
    run = {"meta": {"system": "fcfs"},
           "summary": {"num_completed": 2, "request_throughput": 1.0, "num_preemptions": 0,
                       "normalized_latency": dist, "e2e": dist, "ttft": dist, "tpot": dist},
           "records": [_rec(0.0, 1.0, 30, None), _rec(1.0, 2.0, 40, None)]}
    r = row(run, cap=256)
    assert r["estimate_mae"] is None and r["estimate_under"] is None
    assert r["mean_batch"] is None  # a live run: no simulated iterations
    run["meta"]["details"] = {"sim": {"mean_batch_size": 5.5, "mean_kv_utilization": 0.75,
                                      "tokens_dropped": 120}}
    r = row(run, cap=256)
    assert (r["mean_batch"], r["kv_used"], r["tokens_recomputed"]) == (5.5, 0.75, 120)
