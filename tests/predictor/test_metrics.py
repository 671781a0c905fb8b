"""Metrics and baselines against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from predictor.config import ModelConfig
from predictor.metrics import (
    BucketMedianBaseline,
    MedianBaseline,
    acc_within,
    allocation,
    evaluate_predictions,
    mae,
    padding_row,
)
from predictor.model import bin_index, decode, soft_targets


def test_mae_and_acc() -> None:
    pred = [100.0, 200.0, 300.0, 50.0]
    true = [150, 200, 420, 51]
    # errors 50, 0, 120, 1
    assert mae(pred, true) == pytest.approx((50 + 0 + 120 + 1) / 4)
    assert acc_within(pred, true, 50) == pytest.approx(3 / 4)  # 50 counts as within
    assert acc_within(pred, true, 100) == pytest.approx(3 / 4)
    assert acc_within(pred, true, 120) == pytest.approx(1.0)


def test_padding_row_by_hand() -> None:
    pred = [100.0, 100.0, 200.0]
    true = [105, 120, 100]
    assert allocation(100, 0.10) == 110 and allocation(200, 0.10) == 220
    assert allocation(0.2, 0.0) == 1
    r = padding_row(pred, true, 0.10)
    # allocations 110, 110, 220: the second request (120 > 110) is under-provisioned
    assert r.under_share == pytest.approx(1 / 3)
    assert r.covered_share == pytest.approx(2 / 3)
    assert r.mean_over_tokens == pytest.approx((5 + 0 + 120) / 3)
    assert r.over_pct_of_alloc == pytest.approx(100 * (5 / 110 + 0 + 120 / 220) / 3)
    assert r.under_pct_of_alloc == pytest.approx(100 * (10 / 110) / 3)
    m = evaluate_predictions(pred, true)
    assert [row.ratio for row in m.padding] == [0.0, 0.10, 0.15, 0.20]
    assert m.padding[0].under_share == pytest.approx(2 / 3)  # no padding: 105 and 120 miss
    assert m.padding[3].under_share == pytest.approx(0.0)  # 120 <= 120


def test_baselines() -> None:
    med = MedianBaseline([10, 20, 30, 40])
    assert med.predict([1, 2]) == [25.0, 25.0]
    b = BucketMedianBaseline([5, 6, 100, 100, 120], [10, 30, 200, 300, 400], edges=(8, 64))
    # bucket 0 (<8): median 20; bucket 1 (8..63): empty -> global median 200; bucket 2: 300
    assert b.predict([1, 10, 1000]) == [20.0, 200.0, 300.0]


def test_bins_and_decoders() -> None:
    cfg = ModelConfig(head="bins", bin_width=32, max_len=256)
    assert cfg.n_bins == 8
    assert bin_index(1, cfg) == 0 and bin_index(32, cfg) == 0 and bin_index(33, cfg) == 1
    assert bin_index(10_000, cfg) == 7
    t = soft_targets(torch.tensor([48, 500]), cfg)
    assert torch.allclose(t.sum(-1), torch.ones(2))
    assert int(t[0].argmax()) == 1 and int(t[1].argmax()) == 7
    # All mass in bin 2 ([64, 96)): median = 80, mean = 80, window centre inside it.
    logits = torch.full((1, 8), -1e9)
    logits[0, 2] = 0.0
    assert float(decode(logits, cfg, "median")[0]) == pytest.approx(80.0, abs=0.01)
    assert float(decode(logits, cfg, "mean")[0]) == pytest.approx(80.0)
    w = float(decode(logits, cfg, "window")[0])
    assert 46.0 <= w <= 114.0  # every +-50 window covering [64, 96) holds all the mass
    # Half the mass in bin 0, half in bin 7: the median sits at the boundary
    # of the first bin (CDF reaches 0.5 at 32), the mean in the middle.
    logits = torch.full((1, 8), -1e9)
    logits[0, 0] = 0.0
    logits[0, 7] = 0.0
    assert float(decode(logits, cfg, "median")[0]) == pytest.approx(32.0, abs=0.01)
    assert float(decode(logits, cfg, "mean")[0]) == pytest.approx(128.0)
    log_cfg = ModelConfig(head="log", max_len=256)
    out = decode(torch.tensor([math.log(100.0), 20.0]), log_cfg)
    assert out.tolist() == pytest.approx([100.0, 256.0])
