"""`studies/burst/table.py`: each kind of `served_ab.sh` step as a row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from studies.burst import table


def _burst() -> dict:
    records = [
        # The last first token is the latest first token after its own send.
        {"send_time": 0.0, "token_times": [2.0, 2.5], "prompt_tokens": 10},
        {"send_time": 1.0, "token_times": [4.5], "prompt_tokens": 905},
        {"send_time": 0.0, "token_times": [], "prompt_tokens": 7},  # failed: no token
    ]
    records = [{"request_id": f"req-{i}", "scheduled_time": r["send_time"], **r}
               for i, r in enumerate(records)]
    summary = {"output_token_throughput": 406.57, "ttft": {"mean": 4.133, "p99": 11.456},
               "num_completed": 2, "num_requests": 3}
    return {"summary": summary, "records": records}


def _intake() -> dict:
    return {"intake_s": 2.124, "first_arrival_after_start_s": 0.833,
            "arrival_to_first_plan_median_s": 0.18, "ttft_mean_s": 4.105, "ttft_p99_s": 5.443,
            "run_cpu_ms_per_request": {"ingress": 7.3, "http_proxy": 5.15, "scheduler": 0.8}}


def _idle() -> dict:
    return {"base_url": "x", "reps": 5,
            "ttft": {"16": {"median_ms": 67.8, "min_ms": 61.7},
                     "512": {"median_ms": 873.1, "min_ms": 847.3}}}


@pytest.mark.parametrize("run, cells", [
    (_burst(), ["406.6", "4.13 / 11.46", "3.50, 905", "2/3"]),
    (_intake(), ["0.83", "2.12", "0.18", "7.30 / 5.15 / 0.80", "4.11 / 5.44"]),
    (_idle(), ["67.8 / 61.7", "873.1 / 847.3"]),
])
def test_each_kind_of_step_gives_its_own_cells(run, cells):
    head, got = table.columns(run)
    assert got == cells and len(head) == len(cells)


def test_one_header_then_a_row_a_step_in_the_order_given(tmp_path: Path, monkeypatch, capsys):
    for step in ("n1", "o1"):
        (tmp_path / f"{step}.json").write_text(json.dumps(_burst()))
    monkeypatch.setattr(sys, "argv", ["table", str(tmp_path), "o1", "n1"])
    table.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| run | output tok/s")
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| o1", "| n1"]
