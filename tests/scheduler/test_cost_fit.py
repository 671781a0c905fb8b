"""The live iteration cost fit (scheduler/cost_fit.py)."""

from __future__ import annotations

import random

import pytest

from scheduler.cost import LinearCost
from scheduler.cost_fit import IterationShape, LiveCost, typical_batch

PRIOR = LinearCost(base_s=0.10, prefill_per_token_s=0.003, decode_per_seq_s=0.004,
                   decode_base_s=0.05)
# A replica whose decodes also pay 30 µs per context token and whose
# prefills pay for attention, unlike the start-up fit.
TRUE = (0.05, 0.05, 0.003, 2e-7, 0.004, 3e-5)
# Batch <= 32, 512-token iterations, 1,024-token sequences.
TYPICAL = typical_batch(32, 512, 1024)


def true_time(shape: IterationShape, scale: float = 1.0) -> float:
    return scale * sum(c * x for c, x in zip(TRUE, shape.features()))


def served_shape(rng: random.Random) -> IterationShape:
    """A served batch: up to 32 decodes over 20-900-token contexts and, in
    some iterations, a prefill chunk."""
    shape = IterationShape()
    for _ in range(rng.randint(1, 32)):
        shape = shape.plus(rng.randint(20, 900), 1)
    if rng.random() < 0.4:
        shape = shape.plus(rng.randint(0, 400), rng.choice([32, 128, 256, 512]))
    return shape


def errors(cost: LiveCost, rng: random.Random, scale: float = 1.0) -> list[float]:
    out = sorted(cost.shape_time(s) / true_time(s, scale) - 1
                 for s in (served_shape(rng) for _ in range(200)))
    return out


def test_shape_of_a_batch() -> None:
    # Two decodes at positions 10 and 20 (contexts 11 and 21), a 4-token
    # prefill chunk from position 8: 4 queries over 9..12 keys.
    shape = IterationShape.of([(10, 1), (20, 1), (8, 4)])
    assert shape == IterationShape(decodes=2, decode_context=32, prefill_tokens=4,
                                   prefill_attn=9 + 10 + 11 + 12)
    assert shape.features() == (1.0, 1.0, 4.0, 42.0, 2.0, 32.0)


def test_a_typical_batch() -> None:
    # 32 decodes at 512-token contexts, or a 512-token chunk from 512.
    assert TYPICAL == IterationShape(decodes=32, decode_context=32 * 512, prefill_tokens=512,
                                     prefill_attn=512 * 512 + 512 * 513 // 2)


def test_before_any_iteration_it_is_the_startup_fit() -> None:
    cost = LiveCost(PRIOR, TYPICAL)
    for shape in ([8, 800, 0, 0], [4, 400, 16, 136], [0, 0, 256, 32896]):
        assert cost.batch_time(*shape) == pytest.approx(PRIOR.batch_time(*shape))
    assert cost.prefill_time(100) == PRIOR.prefill_time(100)
    assert cost.decode_time(8) == PRIOR.decode_time(8)


def test_it_learns_the_context_the_startup_fit_misses() -> None:
    rng = random.Random(0)
    cost = LiveCost(PRIOR, TYPICAL)
    before = errors(cost, random.Random(1))
    assert before[len(before) // 2] < -0.3  # the start-up fit is far below
    for _ in range(300):
        shape = served_shape(rng)
        cost.observe(shape, true_time(shape) * rng.uniform(0.95, 1.05))
    after = errors(cost, random.Random(1))
    assert after[10] > -0.08 and after[-10] < 0.08  # 90 % within 8 %
    assert cost.coefficients[5] > 0  # a context term, where the prior had none
    # The start-up fit still sets what MLFQ's quanta come from.
    assert cost.decode_time(1) == PRIOR.decode_time(1)


def test_it_follows_a_host_that_slows_down() -> None:
    rng = random.Random(2)
    cost = LiveCost(PRIOR, TYPICAL, memory=100)
    for _ in range(300):
        shape = served_shape(rng)
        cost.observe(shape, true_time(shape))
    for _ in range(400):  # four memories at 1.5x
        shape = served_shape(rng)
        cost.observe(shape, true_time(shape, 1.5))
    err = errors(cost, random.Random(3), scale=1.5)
    assert err[10] > -0.08 and err[-10] < 0.08


def test_one_stall_does_not_swing_the_fit() -> None:
    rng = random.Random(4)
    cost = LiveCost(PRIOR, TYPICAL)
    for _ in range(200):
        shape = served_shape(rng)
        cost.observe(shape, true_time(shape))
    probe = IterationShape.of([(300, 1)] * 16)
    steady = cost.shape_time(probe)
    cost.observe(probe, 50 * true_time(probe))  # the host stalled once
    assert cost.shape_time(probe) < 1.1 * steady


def test_coefficients_stay_non_negative_and_unexcited_ones_keep_the_prior() -> None:
    cost = LiveCost(PRIOR, TYPICAL)
    # Only decodes, at one context each, getting cheaper with batch size:
    # a least-squares line would have a negative slope.
    for i in range(300):
        b = 1 + i % 16
        cost.observe(IterationShape.of([(100, 1)] * b), 0.2 - 0.005 * b)
    coefs = cost.coefficients
    assert min(coefs) >= 0
    assert coefs[4] == 0 or coefs[5] == 0 or coefs[4] * 100 + coefs[5] * 101 < 1e-3
    # No prefill was seen: its per-token cost is still the start-up fit's.
    assert coefs[2] == pytest.approx(PRIOR.prefill_per_token_s, rel=0.05)


def test_a_bad_sample_is_ignored() -> None:
    cost = LiveCost(PRIOR, TYPICAL)
    cost.observe(IterationShape.of([(10, 1)]), 0.0)
    assert cost.samples == 0
    assert cost.coefficients == LiveCost(PRIOR, TYPICAL).coefficients


def test_small_prompts_do_not_teach_absurd_times_for_large_ones() -> None:
    # A replica that has served one 4-token prompt and its decodes, slower
    # than its start-up fit: what it learnt is weighed at a full batch's
    # scale, so a 512-token chunk is not priced at its attention pairs'
    # share of that one prompt's excess.
    cost = LiveCost(PRIOR, TYPICAL)
    cost.observe(IterationShape.of([(0, 4)]), 0.2)
    for i in range(19):
        cost.observe(IterationShape.of([(4 + i, 1)]), 0.06)
    chunk = IterationShape.of([(0, 512)])
    assert cost.shape_time(chunk) < 2 * PRIOR.prefill_time(512)
