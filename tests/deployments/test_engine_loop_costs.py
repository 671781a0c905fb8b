"""What the engine loop measures of its own iterations, with a fake runner:
how far prompt iterations run over the cost model, the live cost fit's
samples, and the decode cadence (the TPOT autoscaling signal)."""

from __future__ import annotations

import time

import pytest

from deployments.engine_loop import EngineLoop
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.plan import Plan
from tests.deployments.test_engine_loop import Collector, FakeRunner, make_loop, req


def test_prompt_iterations_measure_how_far_the_replica_runs_over_its_cost_model():
    # The TTFT estimate of admission control scales the start-up cost model
    # by this (scheduler/admission.py); decode-only iterations leave it.
    from scheduler.cost import LinearCost
    from scheduler.plan import ScheduledChunk

    core = SchedulerCore(SchedulerConfig(block_size=4, num_blocks=64, max_batch_size=8,
                                         max_batch_tokens=64, max_model_len=64),
                         time.monotonic)
    # 0.01 + 0.001 * tokens: 30 ms for 20 prompt tokens, 11 ms for one decode.
    loop = EngineLoop(FakeRunner(), core, lambda r, i: "ok", Collector(),
                      cost=LinearCost(0.01, 0.001, 0.001))
    prompt = Plan(1, [ScheduledChunk("p", list(range(20)), 0, list(range(5)), True, 0)])
    decode = Plan(2, [ScheduledChunk("d", [3], 9, [2, 3, 4], True, 1)])
    def measure(plan: Plan, elapsed: float) -> None:
        loop.stats.measure_speed(plan, elapsed, 8, 64, loop.cost)

    assert loop.stats.prefill_slowdown == 1.0
    measure(decode, 0.5)
    assert loop.stats.prefill_slowdown == 1.0
    measure(prompt, 0.06)  # twice the model: 1 + 0.1 * (2 - 1)
    assert loop.stats.prefill_slowdown == pytest.approx(1.1)
    for _ in range(100):
        measure(prompt, 0.06)
    assert loop.stats.prefill_slowdown == pytest.approx(2.0, rel=1e-3)


def test_every_iteration_teaches_the_live_cost_fit():
    # The co-serving budget's estimate (scheduler/cost_fit.py) learns from
    # each iteration's whole time; a start-up fit 10x too fast gives way.
    from scheduler.cost import LinearCost
    from scheduler.cost_fit import IterationShape, LiveCost, typical_batch

    live = LiveCost(LinearCost(0.002, 0.0001, 0.0001), typical_batch(8, 64, 64))
    core = SchedulerCore(SchedulerConfig(block_size=4, num_blocks=64, max_batch_size=8,
                                         max_batch_tokens=64, max_model_len=64),
                         time.monotonic, cost=live)
    sink = Collector()
    loop = EngineLoop(FakeRunner(step_s=0.02), core, lambda r, i: "ok", sink,
                      cost=live.prior, live_cost=live)
    loop.start()
    try:
        for i in range(4):
            loop.submit(req(f"r{i}", max_tokens=12))
        sink.wait_finished({f"r{i}" for i in range(4)})
    finally:
        loop.shutdown("done")
    assert live.samples == loop.stats.iterations >= 12
    decode4 = IterationShape.of([(8, 1)] * 4)
    assert 0.015 < live.shape_time(decode4) < 0.03


def test_decode_iterations_record_their_cadence_until_the_loop_idles():
    runner = FakeRunner(step_s=0.004)
    loop, sink, core = make_loop(runner)
    try:
        loop.submit(req("a", max_tokens=8))
        sink.wait_finished({"a"})
        first = list(loop.stats.decode_gaps)
        # Prefill, then seven decodes: six gaps between decode iterations.
        assert len(first) == 6
        assert all(0.004 <= gap < 1.0 for _, gap in first)
        time.sleep(0.05)  # idle: the next request's first gap is not this pause
        loop.submit(req("b", max_tokens=3))
        sink.wait_finished({"b"})
        gaps = [g for _, g in list(loop.stats.decode_gaps)[len(first):]]
        assert len(gaps) == 1 and gaps[0] < 0.05
    finally:
        loop.stop()
