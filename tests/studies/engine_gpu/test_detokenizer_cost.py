"""`studies.engine_gpu.detokenizer_cost` runs and reports each way per answer length."""

from __future__ import annotations

import json
from pathlib import Path

from studies.engine_gpu import detokenizer_cost


def test_reports_each_way_for_text_and_random_answers(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    detokenizer_cost.main(["--lengths", "64,512", "--rounds", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert [(r["tokens"], r["answer_length"]) for r in doc["rows"]] == [
        ("text", 64), ("text", 512), ("random", 64), ("random", 512)]
    for row in doc["rows"]:
        assert row["answers"] == 16384 // row["answer_length"]
        assert all(row[k] > 0 for k in ("decode_stream_us", "detokenizer_us",
                                        "detokenizer_stops_us"))
