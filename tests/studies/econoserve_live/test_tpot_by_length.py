"""`studies/econoserve_live/tpot_by_length.py`: decode time by answer length."""

from __future__ import annotations

import pytest

from studies.econoserve_live.tpot_by_length import breakdown


def test_stalls_and_length_bands() -> None:
    short = {"token_times": [0.0, 0.02, 0.04], "error": None}           # TPOT 20 ms
    long_ = {"token_times": [0.0] + [1.0 + 0.01 * i for i in range(199)],  # one 1 s stall
             "error": None}
    failed = {"token_times": [0.0, 5.0], "error": "timeout"}
    b = breakdown({"meta": {"system": "mlfq"}, "records": [short, long_, failed]})
    assert b["requests"] == 2 and b["stalls"] == 1
    assert b["stalled_s"] == pytest.approx(1.0)
    assert b["decode_s"] == pytest.approx(0.04 + 1.0 + 0.01 * 198)
    assert b["by_length"]["2-63"] == {"requests": 1, "mean_tpot_ms": pytest.approx(20.0)}
    assert b["by_length"]["64-191"]["requests"] == 0
    assert b["by_length"]["192-99999"]["mean_tpot_ms"] == pytest.approx(
        1e3 * (1.0 + 0.01 * 198) / 199)
