"""The clairvoyant orders (bench/oracle.py) on a hand-checked schedule."""

from __future__ import annotations

from bench.oracle import register
from bench.simulator import simulate
from tests.bench.test_simulator import UnitCost, by_id, r, sc

register()


def test_srpt_keeps_a_nearly_done_job_and_sjf_preempts_it():
    # Batch of one, 1 s per iteration.  A (6 tokens) arrives at 0 and has
    # produced 4 by t = 4; B (3 tokens) arrives at 3.5.  SRPT: A has 2 left
    # < 3, so A finishes @6 and B runs @7-9.  SJF: B's answer is shorter
    # than A's, so B runs @5-7 and A finishes @9.  FCFS agrees with SRPT here.
    work = [r("A", 0.0, 4, 6), r("B", 3.5, 4, 3)]
    srpt = by_id(simulate(work, sc(max_batch_size=1, policy="oracle-srpt"), UnitCost()))
    assert srpt["A"].token_times == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert srpt["B"].token_times == [7.0, 8.0, 9.0]
    sjf = by_id(simulate(work, sc(max_batch_size=1, policy="oracle-sjf"), UnitCost()))
    assert sjf["B"].token_times == [5.0, 6.0, 7.0]
    assert sjf["A"].token_times == [1.0, 2.0, 3.0, 4.0, 8.0, 9.0]


def test_srpt_lets_a_short_newcomer_overtake_a_long_job():
    # A (8 tokens) from 0; B (2 tokens) at 1.5 overtakes it at t = 2.
    work = [r("A", 0.0, 4, 8), r("B", 1.5, 4, 2)]
    out = by_id(simulate(work, sc(max_batch_size=1, policy="oracle-srpt"), UnitCost()))
    assert out["B"].token_times == [3.0, 4.0]
    assert out["A"].end_time == 10.0
