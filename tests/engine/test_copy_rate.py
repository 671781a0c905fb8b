"""The host tier's copy rate: measured by the engine, bounding checkpoints."""

from __future__ import annotations

import time

import pytest
import torch

from engine import copy_rate as cr
from engine.kv_cache import KVCache
from engine.swapper import BlockSwapper
from kvstore.tier import LocalHostTier
from scheduler.plan import BlockOp, BlockOpKind


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_busy_period_counts_overlapping_copies_once(monkeypatch) -> None:
    clock = FakeTime()
    monkeypatch.setattr(cr.time, "perf_counter", clock)
    rate = cr.CopyRate()
    assert rate.rate is None
    rate.started()
    rate.started()  # queued behind the first
    clock.t += 1.0
    rate.finished(10)
    assert rate.rate is None  # the period has not ended
    clock.t += 1.0
    rate.finished(30)
    assert rate.rate == pytest.approx(20.0)  # 40 blocks in 2 s, not in 1 + 2 s
    # A faster period moves the estimate by the smoothing weight.
    rate.started()
    clock.t += 0.5
    rate.finished(30)
    assert rate.rate == pytest.approx(cr.SMOOTHING * 60.0 + (1 - cr.SMOOTHING) * 20.0)


def test_the_swapper_measures_its_copies_to_the_tier() -> None:
    cache = KVCache(2, 16, 4, 2, 3, torch.float32, "cpu")
    tier = LocalHostTier(capacity_bytes=10**7)
    sw = BlockSwapper(cache, tier)
    sw.apply([BlockOp(BlockOpKind.SWAP_OUT, "a", 0, [0, 1, 2, 3])])
    sw.apply([BlockOp(BlockOpKind.CHECKPOINT, "b", 0, [8, 9, 10, 11])])
    tier.flush()
    deadline = time.monotonic() + 5
    while sw.copy_rate.rate is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sw.copy_rate.rate is not None and sw.copy_rate.rate > 0
