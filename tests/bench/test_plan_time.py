"""The planning-time benchmark drives the real scheduler core."""

from __future__ import annotations

import json

from bench.plan_time import PlanTimeConfig, main, measure


def test_measure_keeps_the_queue_full_and_plans_real_batches():
    r = measure(PlanTimeConfig(policy="mlfq", queued=60, steps=100, warmup=10,
                               max_batch_size=8, num_blocks=256, host_kv_blocks=512,
                               prompt_len=(4, 64), output_len=(2, 16)))
    assert r.mean_waiting > 20  # the queue stayed populated
    assert r.mean_batch >= 1
    assert r.num_finished > 0  # finished jobs were replaced, not drained
    assert 0 < r.median_us <= r.p90_us <= r.p99_us
    assert r.complete_median_us > 0


def test_main_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    main(["--policies", "mlfq,fcfs", "--queued", "20,40", "--steps", "10", "--warmup", "2",
          "--out", str(out), "--plot", str(png)])
    doc = json.loads(out.read_text())
    assert [(r["config"]["policy"], r["config"]["queued"]) for r in doc["results"]] == [
        ("mlfq", 20), ("mlfq", 40), ("fcfs", 20), ("fcfs", 40)]
    assert png.stat().st_size > 0
