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
    # Proactive swapping keeps a reserve in this small pool: blocks go out
    # and come back.
    assert r.swap_out_blocks > 0 and r.swap_in_blocks > 0


def test_main_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    main(["--policies", "mlfq,fcfs", "--queued", "20,40", "--steps", "10", "--warmup", "2",
          "--out", str(out), "--plot", str(png)])
    doc = json.loads(out.read_text())
    assert [(r["config"]["policy"], r["config"]["queued"]) for r in doc["results"]] == [
        ("mlfq", 20), ("mlfq", 40), ("fcfs", 20), ("fcfs", 40)]
    assert png.stat().st_size > 0


def test_main_passes_the_pool_and_the_copy_rate_to_the_scheduler(tmp_path, monkeypatch):
    """`--num-blocks`, `--host-kv-blocks` and `--copy-rate` reach the plans:
    the rate is what every result reports to the scheduler."""
    import bench.plan_time as pt

    seen: list[tuple[int, int, float | None]] = []
    real = pt.SchedulerCore.complete

    def complete(self, plan, result):  # type: ignore[no-untyped-def]
        seen.append((self.blocks.num_blocks, self.swap.host_capacity, result.copy_rate))
        return real(self, plan, result)

    monkeypatch.setattr(pt.SchedulerCore, "complete", complete)
    out = tmp_path / "plan.json"
    main(["--policies", "mlfq", "--queued", "30", "--steps", "5", "--warmup", "2",
          "--num-blocks", "512", "--host-kv-blocks", "1024", "--copy-rate", "2500",
          "--out", str(out)])
    assert seen and set(seen) == {(512, 1024, 2500.0)}
    cfg = json.loads(out.read_text())["results"][0]["config"]
    assert (cfg["num_blocks"], cfg["host_kv_blocks"], cfg["copy_rate"]) == (512, 1024, 2500.0)


def test_serving_gc_plans_on_the_replicas_heap_and_restores_it(tmp_path, monkeypatch):
    """`--gc serving`: every plan runs with the start-up heap frozen and the
    replica's young threshold (engine/gc_heap.py); afterwards the
    collector is as it was."""
    import gc

    import bench.plan_time as pt
    from engine.gc_heap import SERVING_THRESHOLDS

    seen: set[tuple[tuple[int, int, int], bool]] = set()
    real = pt.SchedulerCore.schedule

    def schedule(self):  # type: ignore[no-untyped-def]
        seen.add((gc.get_threshold(), gc.get_freeze_count() > 0))
        return real(self)

    monkeypatch.setattr(pt.SchedulerCore, "schedule", schedule)
    before = gc.get_threshold(), gc.get_freeze_count()
    main(["--policies", "mlfq", "--queued", "30", "--steps", "5", "--warmup", "2",
          "--gc", "serving", "--out", str(tmp_path / "plan.json")])
    assert seen == {(SERVING_THRESHOLDS, True)}
    assert (gc.get_threshold(), gc.get_freeze_count()) == before
    seen.clear()
    main(["--policies", "mlfq", "--queued", "30", "--steps", "5", "--warmup", "2",
          "--out", str(tmp_path / "plan.json")])
    assert seen == {(before[0], before[1] > 0)}
