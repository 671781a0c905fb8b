"""ENST's T_execute with predicted remaining service (`mlfq.enst: predicted`)."""

from __future__ import annotations

import math
import random

import pytest

from scheduler.config import MLFQConfig
from scheduler.policies.enst import Shortfall, execute_times, prefix_sums
from tests.scheduler.conftest import FakeEngine, make_job
from tests.scheduler.test_mlfq import drain, mlfq_core


def _brute(jobs: list[tuple[int, int, float]], quanta: list[float],
           batch: int) -> dict[int, list[float]]:
    """T_execute from its definition: each job ahead of (class p, level L)
    charged min(the quanta from its level up to L, its remaining time)."""
    P = prefix_sums(quanta)
    out: dict[int, list[float]] = {}
    for p in sorted({c for c, _, _ in jobs}):
        row = []
        for L in range(len(quanta)):
            ahead = 0.0
            for c, lvl, r in jobs:
                if c == p and lvl < L:
                    ahead += min(P[L] - P[lvl], r)
                elif c < p:
                    ahead += min(P[max(L, lvl + 1)] - P[lvl], r)
            row.append(ahead / batch)
        out[p] = row
    return out


@pytest.mark.parametrize("seed", range(30))
def test_shortfall_matches_the_definition(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    quanta = [0.01 * 2**i for i in range(n)]
    classes = rng.sample(range(5), rng.randint(1, 3))
    sf = Shortfall(quanta)
    jobs: dict[str, tuple[int, int, float]] = {}
    for k in range(rng.randint(1, 40)):
        c, lvl = rng.choice(classes), rng.randrange(n)
        r = rng.choice([math.inf, rng.uniform(0, 3 * sum(quanta)), 0.0])
        jobs[f"j{k}"] = (c, lvl, r)
        if r != math.inf:
            sf.set(f"j{k}", c, lvl, r)
    # Moves and departures keep the tallies exact.
    for jid in rng.sample(sorted(jobs), len(jobs) // 3):
        c, lvl, r = jobs[jid]
        if rng.random() < 0.5:
            del jobs[jid]
            sf.discard(jid)
        elif r != math.inf:
            lvl = rng.randrange(n)
            jobs[jid] = (c, lvl, r)
            sf.set(jid, c, lvl, r)
    counts = {c: [0] * n for c in {c for c, _, _ in jobs.values()}}
    for c, lvl, _ in jobs.values():
        counts[c][lvl] += 1
    got = execute_times(counts, quanta, 4, sf)
    want = _brute(list(jobs.values()), quanta, 4)
    for p in want:
        assert got[p] == pytest.approx(want[p], abs=1e-9)
    # Without predictions it is the published T_execute.
    published = _brute([(c, lvl, math.inf) for c, lvl, _ in jobs.values()], quanta, 4)
    plain = execute_times(counts, quanta, 4)
    for p in published:
        assert plain[p] == pytest.approx(published[p], abs=1e-9)


def test_predicted_enst_charges_short_jobs_ahead_less(clock):
    def enst(mode: str) -> tuple[dict[str, float], list[str]]:
        core = mlfq_core(clock, mlfq=MLFQConfig(enst=mode))
        short = [make_job(8, 200) for _ in range(6)]
        deep = make_job(200, 200)
        for j in short:
            j.predicted_output_len = 1
        for j in (*short, deep):
            core.add(j)
        return core.policy.enst(clock()), [deep.job_id, short[0].job_id]

    published, (deep, first) = enst("quanta")
    predicted, (deep2, first2) = enst("predicted")
    # The six short jobs ahead of the deep one finish within a token: its
    # next turn comes much sooner than the quanta down to its level say.
    assert predicted[deep2] < published[deep] / 2
    assert predicted[first2] == pytest.approx(published[first])  # nobody ahead


def test_predicted_enst_leaves_no_tally_behind(clock):
    core = mlfq_core(clock, mlfq=MLFQConfig(enst="predicted"), num_blocks=32,
                     max_model_len=128)
    rng = random.Random(1)
    for _ in range(30):
        j = make_job(rng.randint(4, 60), rng.randint(1, 40))
        j.predicted_output_len = rng.randint(1, 60)
        core.add(j)
    drain(core, FakeEngine(clock))
    sf = core.policy._shortfall
    assert not sf._jobs
    assert all(not any(r.cnt) and not any(abs(x) > 1e-9 for x in r.base + r.cur)
               for r in sf.classes.values())


@pytest.mark.parametrize("seed", range(10))
def test_one_class_alone_gets_the_times_it_gets_beside_an_empty_class(seed):
    """The single-class shortcut of `execute_times` returns, to the bit,
    what the general computation gives that class."""
    rng = random.Random(seed)
    n = rng.randint(1, 14)
    quanta = [rng.uniform(0.001, 0.02) * 2**i for i in range(n)]
    counts = [rng.choice([0, 1, 5, rng.randint(0, 900)]) for _ in range(n)]
    batch = rng.choice([1, 8, 64])
    alone = execute_times({2: counts}, quanta, batch)
    general = execute_times({2: counts, 3: [0] * n}, quanta, batch)
    assert alone == {2: general[2]}
