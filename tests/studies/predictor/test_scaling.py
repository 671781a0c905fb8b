"""The scaling study's trend lines and report, on hand-made runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from studies.predictor.scaling import collect, fit_log2, needed, render, trends


def test_fit_log2_recovers_a_line_in_log2():
    xs = [2, 4, 8, 16]
    a, b = fit_log2(xs, [10 + 3 * math.log2(x) for x in xs])
    assert a == pytest.approx(10)
    assert b == pytest.approx(3)


def test_needed_extrapolates_and_refuses_the_wrong_direction():
    # acc = 0.2 + 0.05 per doubling: 0.3 at x = 4.
    assert needed(0.2, 0.05, 0.3, higher_is_better=True) == pytest.approx(4)
    # Accuracy that falls with the axis never reaches a higher target.
    assert needed(0.2, -0.05, 0.3, higher_is_better=True) is None
    # MAE falling 10 per doubling from 200 at x = 1 reaches 150 at x = 32.
    assert needed(200, -10, 150, higher_is_better=False) == pytest.approx(32)


def _fake_run(root: Path, name: str, points: list[tuple[float, float, float]]) -> None:
    run = root / name
    run.mkdir(parents=True)
    with (run / "curve.jsonl").open("w") as f:
        for i, (m, a50, a100) in enumerate(points):
            f.write(json.dumps({"step": i + 1, "mae": m, "acc50": a50, "acc100": a100}) + "\n")
    (run / "train_summary.json").write_text(
        json.dumps({"train_seconds": 10.0, "prefix_cache_seconds": 1.0}))


def test_trends_per_axis_from_runs(tmp_path: Path):
    _fake_run(tmp_path, "base", [(160, 0.25, 0.45)])
    _fake_run(tmp_path, "depth16", [(150, 0.27, 0.48)])
    _fake_run(tmp_path, "depth30", [(145, 0.28, 0.50)])
    _fake_run(tmp_path, "depth30-lora8", [(140, 0.30, 0.55)])
    _fake_run(tmp_path, "epochs3", [(158, 0.25, 0.45), (154, 0.26, 0.46), (153, 0.26, 0.47)])
    rows = collect(tmp_path)
    assert [r["name"] for r in rows] == ["base", "depth16", "depth30", "depth30-lora8", "epochs3"]
    targets = {"mae": 140.0, "acc50": 0.59, "acc100": 0.81}
    by_axis = {t["axis"]: t for t in trends(rows, targets)}
    assert set(by_axis) == {"depth", "lora_layers", "epochs"}  # no runs on the others
    # LoRA layers are compared at the same depth: depth30 is the 4-layer point.
    lora = by_axis["lora_layers"]
    assert [(x, p["mae"]) for x, p in lora["points"]] == [(4, 145), (8, 140)]
    depth = by_axis["depth"]
    assert [p[0] for p in depth["points"]] == [8, 16, 30]
    assert depth["fits"]["mae"]["per_doubling"] < 0
    # Acc-50 gains ~0.016 per doubling from 0.25 at 8 layers: far beyond 30.
    assert depth["fits"]["acc50"]["needed"] > 1e6
    # Epochs come from the 3-epoch run's curve, one point per epoch.
    assert [p[0] for p in by_axis["epochs"]["points"]] == [1, 2, 3]
    report = {"command": "python -m studies.predictor scaling", "eval_samples": 600,
              "baselines": {"bucket_median": {"mae": 175.0, "acc50": 0.2, "acc100": 0.4}},
              "targets": targets, "runs": rows, "trends": trends(rows, targets)}
    md = render(report)
    assert "| depth30 | depth | 30 | 145.0 | 28.0% | 50.0% | 11 |" in md
