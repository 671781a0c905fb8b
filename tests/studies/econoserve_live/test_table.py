"""The live EconoServe table matches a live trace's server-side job ids to
the client's records and measures KV use the same way live and replayed."""

from __future__ import annotations

import math

from studies.econoserve_live.table import NUM_BLOCKS, _align, _match, arrived_share, kv_utilization


def _run(ids: dict[str, str], skew: float) -> tuple[list[dict], list[dict]]:
    """Two requests, A (prompt 20, 3 tokens) from t=0 and B (prompt 40,
    2 tokens) from t=1, one iteration a second; the trace's clock is the
    records' plus `skew`, its jobs named by `ids`."""
    trace = [
        {"t": 0.0 + skew, "iteration_time": 1.0, "jobs": [ids["A"]], "preempted": []},
        {"t": 1.0 + skew, "iteration_time": 1.0, "jobs": [ids["A"], ids["B"]], "preempted": []},
        {"t": 2.0 + skew, "iteration_time": 1.0, "jobs": [ids["A"], ids["B"]], "preempted": []},
    ]
    records = [
        {"request_id": "A", "send_time": 0.0, "prompt_tokens": 20, "output_tokens": 3,
         "token_times": [1.01, 2.01, 3.01], "end_time": 3.01},
        {"request_id": "B", "send_time": 1.0, "prompt_tokens": 40, "output_tokens": 2,
         "token_times": [2.01, 3.01], "end_time": 3.01},
    ]
    return trace, records


def test_server_ids_are_matched_by_first_token_and_length() -> None:
    trace, records = _run({"A": "cmpl-x", "B": "cmpl-y"}, skew=1000.0)
    shift = _align(trace, records)
    assert math.isclose(shift, -1000.0 + 0.01)
    m = _match(trace, records, shift)
    assert {j: r["request_id"] for j, r in m.items()} == {"cmpl-x": "A", "cmpl-y": "B"}


def test_kv_use_is_the_iterations_jobs_context_in_blocks() -> None:
    expected = [
        math.ceil(20 / 16),  # A's prompt
        math.ceil(21 / 16) + math.ceil(40 / 16),  # A after a token, B's prompt
        math.ceil(22 / 16) + math.ceil(41 / 16),
    ]
    want = sum(expected) / len(expected) / NUM_BLOCKS
    for ids, skew in (({"A": "A", "B": "B"}, 0.0), ({"A": "s1", "B": "s2"}, 55.0)):
        trace, records = _run(ids, skew)
        assert math.isclose(kv_utilization(trace, records), want)


def test_the_share_finished_while_requests_arrive() -> None:
    records = [{"send_time": float(t), "end_time": t + 0.5} for t in range(10)]
    records[-1]["end_time"] = None
    records[-2]["end_time"] = 20.0
    rate, share = arrived_share(records)
    assert math.isclose(rate, 10 / 9) and share == 0.8
