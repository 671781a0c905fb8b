"""The sampler benchmark runs the three methods and writes its JSON."""

from __future__ import annotations

import json

from bench.sampling_bench import main


def test_writes_every_case(tmp_path):
    out = tmp_path / "s.json"
    main(["--batch", "4", "--vocab", "512", "--scales", "3", "--reps", "2", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert [r["case"] for r in doc["results"]] == [
        "temperature", "temperature_bf16", "top_p", "top_k", "seeded"]
    assert all(r["ours_ms"] > 0 and r["torch_path_ms"] > 0 and r["textbook_ms"] > 0
               and r["batch"] == 4 for r in doc["results"])
