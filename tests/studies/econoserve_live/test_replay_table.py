"""`studies/econoserve_live/replay_table.py`: common-cost replays per policy."""

from __future__ import annotations

from typing import Any

import pytest

from studies.econoserve_live.replay_table import FIGURES, by_policy


def _row(system: str, nl: float) -> dict[str, Any]:
    return {"system": system, **{f: 1.0 for f in FIGURES}, "mean_nl_ms": nl}


def test_policies_are_summed_over_answers_and_tables() -> None:
    table_a = [_row("fcfs@r1", 40.0), _row("mlfq@r1", 50.0),
               _row("fcfs@r2", 60.0), _row("mlfq@r2", 55.0)]
    table_b = [_row("fcfs@r1", 45.0), _row("mlfq@r1", 44.0)]
    s = by_policy([table_a, table_b])
    assert s["fcfs"]["replays"] == 3 and s["mlfq"]["replays"] == 3
    # Lowest per (answers, table): fcfs on r1/a; mlfq on r2/a and r1/b.
    assert s["fcfs"]["lowest_mean_nl"] == 1 and s["mlfq"]["lowest_mean_nl"] == 2
    assert s["fcfs"]["mean_nl_ms"] == {"mean": pytest.approx(145 / 3), "min": 40.0,
                                       "max": 60.0}
