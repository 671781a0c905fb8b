"""`studies.engine_gpu.invariant_matmul --large-rows` runs between GPU
sessions: tiny shapes (on CPU tensors under Triton's interpreter where no
GPU is), each launch timed once instead of replayed from a graph."""

from __future__ import annotations

import pytest
import torch

from studies.engine_gpu import invariant_matmul


def test_large_rows_times_every_row_count_three_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def once(fn):  # type: ignore[no-untyped-def]
        out = fn()
        calls.append(out.shape[0])
        return 1e-3

    monkeypatch.setattr(invariant_matmul, "graph_time", once)
    monkeypatch.setattr(invariant_matmul, "SHAPES", [("o", 64, 256, 2), ("head", 96, 256, 1)])
    monkeypatch.setattr(invariant_matmul, "PREFILL_ROWS", (16, 40))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = invariant_matmul.large_rows(dev)
    assert [r["rows"] for r in result["rows"]] == [16, 40]
    # Per row count: two shapes, three ways, the head on one row (a prefill).
    assert calls == [16, 1] * 3 + [40, 1] * 3
    assert all(r[k] == pytest.approx(3.0) for r in result["rows"]
               for k in ("cublas_ms", "config_ms", "large_ms"))
