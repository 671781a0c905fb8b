"""The GPU scripts' summary of their serving-loop runs (studies/engine_gpu/loops_summary.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from studies.engine_gpu.loops_summary import main


def test_collects_the_runs_that_exist_and_prints_a_line_each(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = {"output_tokens_per_s": 1234.567, "iterations": 10, "all_finished": True,
           "ttft_s": {"p50": 0.123, "p99": 1.0}, "other": 1}
    (tmp_path / "loop_sync.json").write_text(json.dumps(run))
    main([str(tmp_path), str(tmp_path / "loop_sync.json"), str(tmp_path / "loop_ahead.json")])
    assert json.loads((tmp_path / "loops.json").read_text()) == {"loop_sync": run}
    line = capsys.readouterr().out.strip()
    assert line.startswith("loop_sync {'output_tokens_per_s': 1234.57, 'iterations': 10")
    assert "'other'" not in line and "'p50': 0.12" in line
