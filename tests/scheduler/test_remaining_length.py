"""Refining a running job's remaining length from what it has generated."""

from __future__ import annotations

import pytest

from scheduler.remaining_length import RemainingLength
from tests.scheduler.conftest import FakeClock, FakeEngine, drain
from tests.scheduler.test_econoserve import econo_core, job, policy_of


def test_silent_until_enough_jobs_finished() -> None:
    rl = RemainingLength(min_samples=5, min_tail=2)
    for _ in range(4):
        rl.observe(100, 200)
    assert rl.remaining(100, 50) is None
    rl.observe(100, 200)
    assert rl.remaining(100, 50) == 150


def test_conditions_on_the_tokens_generated() -> None:
    rl = RemainingLength(quantile=0.5, min_samples=10, min_tail=3)
    for r in range(1, 21):  # ratios 0.25 .. 5.0
        rl.observe(100, 25 * r)
    # Past 100 tokens, 16 jobs went on (125 .. 500): the median of what is left.
    assert rl.remaining(100, 100) == pytest.approx(325 - 100)
    # Further on, fewer went on and those went further.
    assert rl.remaining(100, 400) == 475 - 400
    # Past what nearly all of them reached: too few to say.
    assert rl.remaining(100, 460) is None
    # A higher quantile covers more of the tail.
    hi = RemainingLength(quantile=0.9, min_samples=10, min_tail=3)
    for r in range(1, 21):
        hi.observe(100, 25 * r)
    assert hi.remaining(100, 100) > rl.remaining(100, 100)


def test_the_window_forgets_old_jobs() -> None:
    rl = RemainingLength(min_samples=4, min_tail=2, window=8)
    for _ in range(8):
        rl.observe(10, 40)
    assert rl.remaining(10, 10) == 30
    for _ in range(8):
        rl.observe(10, 20)
    assert len(rl) == 8
    assert rl.remaining(10, 10) == 10


@pytest.mark.parametrize("mode,overruns", [("growth", 2), ("refined", 1)])
def test_econoserve_extends_an_overrun_by_the_refined_estimate(mode: str, overruns: int) -> None:
    clock = FakeClock()
    core = econo_core(clock, econoserve={"pt_reserve": 0.25, "overrun_extension": mode})
    policy = policy_of(core)
    if policy.lengths is not None:
        for _ in range(60):  # answers ran 3x their predictions
            policy.lengths.observe(4, 12)
    j = job(4, 12, alloc=4)
    j.predicted_output_len = 4
    core.add(j)
    drain(core, FakeEngine(clock))
    assert j.num_output_tokens == 12
    # Growth: 4 -> 8 -> 12, two overruns; refined: 4 -> 12 at once.
    assert policy.num_overruns == overruns


def test_only_jobs_that_ended_by_themselves_teach_it() -> None:
    core = econo_core(FakeClock(), econoserve={"overrun_extension": "refined"})
    policy = policy_of(core)
    assert policy.lengths is not None
    for reason in ("stop", "length", "abort"):
        j = job(4, 30)
        j.predicted_output_len = 10
        j.output_token_ids = [1] * 20
        j.finish_reason = reason
        policy.remove(j)
    assert len(policy.lengths) == 1
