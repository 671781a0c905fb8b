"""The sampler benchmark runs the three methods and writes its JSON."""

from __future__ import annotations

import json

import torch

import engine.top_k_top_p
from bench.sampling_bench import _cut_times, main
from engine.sampling import SamplingParams


def test_writes_every_case(tmp_path):
    out = tmp_path / "s.json"
    main(["--batch", "4", "--vocab", "512", "--scales", "3", "--reps", "2", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert [r["case"] for r in doc["results"]] == [
        "temperature", "temperature_bf16", "top_p", "top_k", "top_k_top_p", "seeded"]
    assert all(r["ours_ms"] > 0 and r["torch_path_ms"] > 0 and r["textbook_ms"] > 0
               and r["batch"] == 4 for r in doc["results"])


def test_cut_times_time_the_search_and_the_sort(monkeypatch):
    """The GPU's cut timed searched (here under Triton's interpreter), then
    sorted, and the choice restored after."""
    monkeypatch.setattr(engine.top_k_top_p, "_search_failed", False)  # put back after
    chosen = engine.top_k_top_p._searched_or_sorted
    searched = []
    monkeypatch.setattr(engine.top_k_top_p, "_searched_or_sorted",
                        lambda lg, k, p, search=None: searched.append(search)
                        or chosen(lg, k, p, search=search))
    wrapped = engine.top_k_top_p._searched_or_sorted
    times = _cut_times(torch.randn(2, 300), SamplingParams(temperature=0.8, top_p=0.9), 2)
    assert times["cut_ms"] > 0 and times["cut_sorted_ms"] > 0
    assert set(searched) == {True, False}
    assert engine.top_k_top_p._searched_or_sorted is wrapped
