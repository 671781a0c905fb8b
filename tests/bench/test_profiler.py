"""The profiler's driving and fitting logic against a fake runner; the real
engine only when it is importable and the slow tests are asked for."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from bench.costmodel import BatchShape
from bench.costtable import TableCostModel
from bench.profiler import ProfileConfig, profile
from scheduler.plan import JobOutput, Plan, StepResult


class FakeRunner:
    """Sleeps a known linear cost per plan; samples token 7."""

    # Large enough that the scheduler's own work and sleep overshoot on a
    # loaded 2-core machine (a few ms) stay within the tolerances below.
    COST = dict(const=0.008, prefill_tokens=8e-5, decode_tokens=2e-3)

    def __init__(self, model: str, **kw: Any) -> None:
        self.kw = kw
        self.requests: set[str] = set()
        self.vocab_size = 1000

    def add_request(self, job_id: str, params: Any, prompt_token_ids: list[int]) -> None:
        assert job_id not in self.requests and prompt_token_ids
        assert params.max_tokens >= 1 and params.ignore_eos
        self.requests.add(job_id)

    def remove_request(self, job_id: str) -> None:
        self.requests.discard(job_id)

    def execute(self, plan: Plan) -> StepResult:
        if plan.block_ops:
            raise NotImplementedError("no KV tier")
        s = BatchShape.of(plan)
        c = self.COST
        t = c["const"] + c["prefill_tokens"] * s.prefill_tokens + c["decode_tokens"] * s.decode_tokens
        time.sleep(t)
        for ch in plan.chunks:
            assert ch.job_id in self.requests
        return StepResult(plan.step, [JobOutput(ch.job_id, 7) for ch in plan.chunks if ch.sample], t)


def test_profile_with_fake_runner():
    cfg = ProfileConfig(model="fake", prefill_lens=[16, 128], decode_batches=[1, 4],
                        contexts=[16, 48], repeats=2, fill_batch_tokens=64, max_model_len=256)
    logs: list[str] = []
    table = profile(cfg, log=logs.append, runner_factory=FakeRunner)
    assert table.swaps == [] and any("swap: not measured" in x for x in logs)
    kinds = {(m.prefill_tokens > 0, m.decode_tokens > 0) for m in table.measurements}
    assert {(True, False), (False, True)} <= kinds  # prefill-only and decode-only
    assert all(m.engine_time is not None and m.time >= m.engine_time for m in table.measurements)
    model = TableCostModel(table)
    for shape in (BatchShape(decode_tokens=4, decode_context=100),
                  BatchShape(prefill_tokens=128, prefill_chunks=1, prefill_attn=128 * 129 // 2)):
        c = FakeRunner.COST
        want = c["const"] + c["prefill_tokens"] * shape.prefill_tokens + c["decode_tokens"] * shape.decode_tokens
        # Wall times include the scheduler's own work on a shared CPU.
        assert model.iteration_time(shape) == pytest.approx(want, rel=0.35, abs=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("BENCH_PROFILE_ENGINE"),
                    reason="set BENCH_PROFILE_ENGINE=1 to profile the real engine (~20 s)")
def test_profile_real_engine():
    pytest.importorskip("torch")
    try:
        import engine.runner  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"engine.runner not usable: {e}")
    cfg = ProfileConfig(prefill_lens=[8, 32], decode_batches=[1, 4], contexts=[16, 64], repeats=2,
                        swap_blocks=[1])
    table = profile(cfg, log=lambda s: None)
    assert table.fit_error is not None and table.measurements
    m = TableCostModel(table)
    assert m.iteration_time(BatchShape(decode_tokens=4, decode_context=200)) > 0


def test_table_from_server_iterations_uses_their_shapes_and_wall_times():
    from bench.profiler import table_from_iterations

    rows = []
    for b in (1, 2, 4, 8):
        for ctx in (40, 200):
            rows.append(([(ctx - 1, 1)] * b, 0.01 * b, 0.02 + 0.01 * b + 1e-5 * b * ctx))
    rows.append(([(0, 64), (99, 1)], 0.1, 0.2))
    table = table_from_iterations(rows, model="m", device="cpu", dtype="float32",
                                  num_threads=1, block_size=16)
    assert len(table.measurements) == len(rows)
    mixed = table.measurements[-1]
    assert (mixed.prefill_tokens, mixed.prefill_chunks, mixed.prefill_attn) == (64, 1, 64 * 65 // 2)
    assert (mixed.decode_tokens, mixed.decode_context, mixed.time) == (1, 100, 0.2)
    model = TableCostModel(table)
    got = model.iteration_time(BatchShape(decode_tokens=4, decode_context=4 * 200))
    assert got == pytest.approx(0.02 + 0.04 + 1e-5 * 800, rel=1e-9)


def test_a_table_knows_the_swap_traffic_only_where_it_kept_a_blocks_bytes():
    from bench.costtable import SwapMeasurement
    from bench.metrics import summarize
    from bench.profiler import table_from_iterations
    from bench.simulator import simulate
    from bench.workload import RequestSpec
    from scheduler.config import SchedulerConfig

    rows = [([(ctx - 1, 1)] * b, 0.01 * b, 0.02 + 0.01 * b + 1e-5 * b * ctx)
            for b in (1, 2, 4, 8) for ctx in (40, 200)]
    rows.append(([(0, 64), (99, 1)], 0.1, 0.2))
    table = table_from_iterations(rows, model="m", device="cpu", dtype="float32",
                                  num_threads=1, block_size=16,
                                  swaps=[SwapMeasurement(blocks=n, time=1e-4 * n) for n in (1, 8)])
    # Eight jobs of 96 blocks' worth on 24 blocks: MLFQ swaps them in turn.
    reqs = [RequestSpec(request_id=f"r{i}", arrival_time=0.01 * i, prompt_tokens=64,
                        output_tokens=128) for i in range(8)]
    sc = SchedulerConfig(policy="mlfq", num_blocks=24, block_size=16, host_kv_blocks=512,
                         swap_mode="reactive", max_batch_size=4, max_batch_tokens=256,
                         max_model_len=384)
    unknown = simulate(reqs, sc, TableCostModel(table))
    assert unknown.stats.swap_blocks > 0
    assert unknown.stats.swap_bytes is None
    assert summarize(unknown.records, None).swap_bytes is None  # not reported as 0
    known = simulate(reqs, sc, TableCostModel(table.model_copy(update={"block_bytes": 4096})))
    assert known.stats.swap_bytes == known.stats.swap_blocks * 4096 > 0
    assert summarize(known.records, None).swap_bytes == known.stats.swap_bytes
