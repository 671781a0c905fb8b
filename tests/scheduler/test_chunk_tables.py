"""A chunk's block table is its job's table when the plan was made, and
stays so: plans hand the engine one copy per change of a job's table
(`Job.table_copy`), shared by the chunks of the plans in between."""

from __future__ import annotations

import random

import pytest

from tests.scheduler.conftest import FakeEngine, make_job
from tests.scheduler.test_mlfq import mlfq_core


@pytest.mark.parametrize("policy,swap_mode,prefix_caching", [
    ("fcfs", "recompute", False), ("fcfs", "reactive", True),
    ("mlfq", "proactive", True), ("mlfq", "reactive", False)])
def test_chunk_tables_are_the_job_s_table_then_and_never_change(
        clock, policy, swap_mode, prefix_caching):
    rng = random.Random(7)
    core = mlfq_core(clock, policy=policy, swap_mode=swap_mode, num_blocks=40, max_model_len=128,
                     host_kv_blocks=64 if swap_mode != "recompute" else 0,
                     prefix_caching=prefix_caching)
    engine = FakeEngine(clock)
    for _ in range(30):
        core.add(make_job(rng.randint(2, 40), rng.randint(1, 40), t=clock()))
    seen: list[tuple[list[int], list[int]]] = []
    shared = changed = 0
    last: dict[str, list[int]] = {}
    while core.has_work:
        plan = core.schedule()
        for c in plan.chunks:
            table = core.jobs[c.job_id].block_table
            assert c.block_table == table and c.block_table is not table
            seen.append((c.block_table, list(c.block_table)))
            prev = last.get(c.job_id)
            shared += prev is c.block_table
            changed += prev is not None and prev is not c.block_table
            last[c.job_id] = c.block_table
        core.complete(plan, engine.execute(plan))
        clock.advance(0.01)
    assert all(held == then for held, then in seen)
    assert shared and changed  # both paths were taken
