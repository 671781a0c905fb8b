"""The latency study's figures from a run's records: a server that keeps
up and one whose queue grows, the objectives counted over the requests
offered (a refusal counts against)."""

from __future__ import annotations

import json
from pathlib import Path

from studies.latency_vs_vllm.report import summarize


def _run(tmp_path: Path, service_s: float, refuse: int = 0) -> Path:
    """100 requests, one a second; each is served `service_s` after the
    previous one ended (one at a time), with 10 tokens 0.05 s apart."""
    records, free = [], 0.0
    for i in range(100):
        t = float(i)
        rec = {"request_id": f"r{i}", "scheduled_time": t, "send_time": t,
               "prompt_tokens": 5, "output_tokens": 10}
        if i < refuse:
            rec |= {"rejected": True, "end_time": t + 0.01, "output_tokens": 0}
        else:
            start = max(t, free) + service_s
            rec |= {"token_times": [start + 0.05 * k for k in range(10)],
                    "end_time": start + 0.45}
            free = start + 0.45
        records.append(rec)
    path = tmp_path / f"run_{service_s}_{refuse}.json"
    path.write_text(json.dumps({"meta": {"workload": {"streams": [
        {"arrivals": {"rate": 1.0, "cv": 1.0}}]}}, "records": records}))
    return path


def test_a_server_that_keeps_up_and_one_that_falls_behind(tmp_path: Path) -> None:
    ok = summarize(_run(tmp_path, 0.1), ttft_slo=2.0, tpot_slo=0.2)
    assert ok["completed"] == 100 and ok["sustained"] and ok["kept_up"] > 0.95
    assert abs(ok["ttft_p50"] - 0.1) < 1e-9 and abs(ok["ttft_p99"] - 0.1) < 1e-9
    assert ok["attainment"] == 1.0
    # 1.5 s a request against one a second: its queue grows all run long.
    slow = summarize(_run(tmp_path, 1.05), ttft_slo=2.0, tpot_slo=0.2)
    assert not slow["sustained"] and slow["kept_up"] < 0.7
    assert slow["ttft_p99"] > 30 and slow["attainment"] < 0.1
    # A TPOT objective below the 50 ms between tokens fails every request.
    assert summarize(_run(tmp_path, 0.1), ttft_slo=2.0, tpot_slo=0.04)["attainment"] == 0.0


def test_refusals_count_against_the_objectives(tmp_path: Path) -> None:
    got = summarize(_run(tmp_path, 0.1, refuse=10), ttft_slo=2.0, tpot_slo=0.2)
    assert got["rejected"] == 10 and got["completed"] == 90
    assert got["attainment"] == 0.9
