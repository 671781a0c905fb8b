"""Cost models: the analytic A100 roofline and the fitted table."""

from __future__ import annotations

import numpy as np
import pytest

from bench.costmodel import TABLE_FEATURES, AnalyticCostModel, BatchShape, make_cost_model
from bench.costtable import (
    CostTable,
    Measurement,
    SwapMeasurement,
    TableCostModel,
    fit_nonnegative,
)
from scheduler.plan import BlockOp, BlockOpKind, Plan, ScheduledChunk


def chunk(jid: str, n: int, start: int, sample: bool = True) -> ScheduledChunk:
    return ScheduledChunk(job_id=jid, token_ids=[0] * n, start_pos=start, block_table=[],
                          sample=sample, output_index=1 if n == 1 else 0)


def test_batch_shape_of_plan():
    plan = Plan(step=1, chunks=[
        chunk("d1", 1, 99),  # decode at context 100
        chunk("d2", 1, 9),  # decode at context 10
        chunk("p", 4, 6, sample=False),  # prefill chunk at offset 6
    ], block_ops=[BlockOp(BlockOpKind.SWAP_OUT, "x", 0, [3]), BlockOp(BlockOpKind.DROP, "y", 0, [])])
    s = BatchShape.of(plan)
    assert (s.decode_tokens, s.decode_context) == (2, 110)
    assert (s.prefill_tokens, s.prefill_chunks) == (4, 1)
    assert s.prefill_attn == 4 * 6 + 4 * 5 // 2  # 7 + 8 + 9 + 10
    assert s.prefill_kv == 10
    assert s.num_sampled == 2 and s.swap_blocks == 1


def test_opt_shapes_match_table_1():
    m13 = AnalyticCostModel.preset("opt-13b")
    assert m13.model.num_params == pytest.approx(12.85e9, rel=0.01)
    assert m13.model.weight_bytes == pytest.approx(26e9, rel=0.02)  # Table 1: 26 GB
    assert AnalyticCostModel.preset("opt-66b").model.weight_bytes == pytest.approx(132e9, rel=0.02)
    assert AnalyticCostModel.preset("opt-175b").model.weight_bytes == pytest.approx(350e9, rel=0.01)
    # KV: 4 * layers * hidden bytes per token (FastServe §4.2: 4·l·h).
    assert m13.model.kv_bytes_per_token == 4 * 40 * 5120


def test_decode_is_memory_bound_prefill_compute_bound():
    m = AnalyticCostModel.preset("opt-13b", "a100-80gb")
    t1 = m.iteration_time(BatchShape(decode_tokens=1, decode_context=1, num_sampled=1))
    weights_read = m.model.weight_bytes / (2.0e12 * 0.8)
    assert t1 == pytest.approx(weights_read + 1e-3, rel=0.05)
    # Batching decodes is almost free while weights dominate.
    t8 = m.iteration_time(BatchShape(decode_tokens=8, decode_context=8, num_sampled=8))
    assert t8 < 1.05 * t1
    # Long prefills scale with FLOPs: 2 * params * tokens at 60% of 312 TF/s.
    n = 2000
    tp = m.iteration_time(BatchShape(prefill_tokens=n, prefill_chunks=1, prefill_attn=n * (n + 1) // 2,
                                     prefill_kv=n, num_sampled=1))
    assert tp == pytest.approx(2 * 12 * 5120**2 * 40 * n / (312e12 * 0.6), rel=0.15)
    # The 40 GB part has less HBM bandwidth and far fewer KV blocks.
    m40 = AnalyticCostModel.preset("opt-13b", "a100-40gb")
    assert m40.iteration_time(BatchShape(decode_tokens=1, decode_context=1, num_sampled=1)) > t1
    assert m40.num_kv_blocks() < m.num_kv_blocks() / 3


def test_tensor_parallel_splits_work_and_adds_allreduce():
    base = AnalyticCostModel.preset("opt-66b", tp=1, gpu="a100-80gb")
    tp4 = AnalyticCostModel.preset("opt-66b", tp=4, gpu="a100-80gb")
    s = BatchShape(decode_tokens=16, decode_context=16 * 500, num_sampled=16)
    assert tp4.iteration_time(s) < base.iteration_time(s) / 3
    assert tp4.layer_time(s) > base.layer_time(s) / 4  # communication is not free
    pp = AnalyticCostModel.preset("opt-175b")
    assert (pp.tp, pp.pp) == (8, 2)
    with pytest.raises(ValueError):
        AnalyticCostModel.preset("opt-175b", tp=1, pp=1).num_kv_blocks()


def test_swap_time_is_pcie_bound():
    m = AnalyticCostModel.preset("opt-13b")
    per_block = 16 * 4 * 40 * 5120 / 25e9
    assert m.swap_time(100) == pytest.approx(100 * per_block + 10e-6)
    assert m.swap_time(0) == 0.0


def test_nonnegative_fit():
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(50), rng.uniform(0, 10, 50), rng.uniform(0, 10, 50)])
    y = x @ np.array([0.5, 0.2, 0.0]) - 0.01 * x[:, 2]  # a slightly negative true coef
    c = fit_nonnegative(x, y)
    assert (c >= 0).all() and c[2] == 0.0


def test_table_fit_recovers_linear_costs():
    true = dict(const=0.04, prefill_tokens=0.001, prefill_attn=1e-7, prefill_chunks=0.002,
                decode_tokens=0.006, decode_context=2e-6)
    ms = []
    for p in (16, 64, 256, 512):
        s = BatchShape(prefill_tokens=p, prefill_chunks=1, prefill_attn=p * (p + 1) // 2)
        ms.append(s)
    for b in (1, 4, 16, 32):
        for c in (64, 512):
            ms.append(BatchShape(decode_tokens=b, decode_context=b * c))
    ms.append(BatchShape(prefill_tokens=100, prefill_chunks=1, prefill_attn=100 * 300,
                         decode_tokens=8, decode_context=800))
    coef = np.array([true[f] for f in TABLE_FEATURES])
    table = CostTable(
        model="m", device="cpu", dtype="bf16", block_size=16,
        measurements=[Measurement(
            prefill_tokens=s.prefill_tokens, prefill_attn=s.prefill_attn,
            prefill_chunks=s.prefill_chunks, decode_tokens=s.decode_tokens,
            decode_context=s.decode_context, time=float(np.dot(coef, s.features())),
        ) for s in ms],
        swaps=[SwapMeasurement(blocks=n, time=0.001 + 0.0002 * n) for n in (1, 8, 32)],
    )
    model = TableCostModel(table)  # fits on load
    # Prefill work is linear and recovered; decodes come from the grid.
    for f in ("const", "prefill_tokens", "prefill_attn", "prefill_chunks"):
        assert model.table.coef[f] == pytest.approx(true[f], rel=1e-3, abs=1e-12)
    assert model.table.fit_error < 1e-6
    # Inside the grid a bilinear truth is interpolated exactly.
    s = BatchShape(decode_tokens=8, decode_context=8 * 200)
    assert model.iteration_time(s) == pytest.approx(float(np.dot(coef, s.features())), rel=1e-9)
    s = BatchShape(decode_tokens=10, decode_context=3000)
    assert model.iteration_time(s) == pytest.approx(0.04 + 0.06 + 0.006)
    assert model.swap_time(10) == pytest.approx(0.003)
    assert model.iteration_time(BatchShape()) == 0.0


def test_make_cost_model(tmp_path):
    assert make_cost_model("opt-13b").model.name == "OPT-13B"
    t = CostTable(model="m", device="cpu", dtype="bf16", block_size=16,
                  measurements=[Measurement(decode_tokens=1, decode_context=10, time=0.05),
                                Measurement(decode_tokens=2, decode_context=20, time=0.06)])
    path = tmp_path / "t.json"
    path.write_text(t.model_dump_json())
    m = make_cost_model(str(path))
    assert isinstance(m, TableCostModel)
    with pytest.raises(ValueError):
        make_cost_model("gpt-5")


def test_table_decode_grid_follows_a_nonlinear_batch_curve():
    # A CPU-like decode: matrix-vector at batch 1, a jump to GEMM, then
    # context cost that grows with the batch; no linear model fits it.
    def truth(b: int, c: int) -> float:
        return (0.05 if b == 1 else 0.09 + 0.004 * b) + 1e-6 * b * c * (1 + b / 8)

    ms = [Measurement(decode_tokens=b, decode_context=b * c, time=truth(b, c))
          for b in (1, 4, 8, 16, 32) for c in (64, 256, 768) for _ in range(3)]
    ms.append(Measurement(prefill_tokens=64, prefill_chunks=1, prefill_attn=64 * 65 // 2, time=0.2))
    model = TableCostModel(CostTable(model="m", device="cpu", dtype="fp32", block_size=16,
                                     measurements=ms))
    for b in (1, 4, 8, 16, 32):
        for c in (64, 256, 768):
            got = model.iteration_time(BatchShape(decode_tokens=b, decode_context=b * c))
            assert got == pytest.approx(truth(b, c), rel=1e-9)
    mid = model.iteration_time(BatchShape(decode_tokens=24, decode_context=24 * 256))
    assert truth(16, 256) < mid < truth(32, 256)
    assert model.table.fit_error < 1e-6
    # A linear model in the same features misses some points by > 10 %.
    x = np.asarray([m.shape().features() for m in ms])
    y = np.asarray([m.time for m in ms])
    c = fit_nonnegative(x / y[:, None], np.ones_like(y))
    assert np.max(np.abs(x @ c - y) / y) > 0.1

