"""The loop's records of recent iterations and plans: what they give back,
and that a busy replica's records leave the garbage collector alone."""

from __future__ import annotations

import gc

from deployments.loop_stats import LoopStats
from scheduler.iteration import Iteration
from scheduler.plan import BlockOp, BlockOpKind, JobOutput, Plan, ScheduledChunk, StepResult
from scheduler.trace import StepTrace


def _iteration(step: int) -> Iteration:
    chunks = [ScheduledChunk("a", [1, 2, 3], 0, [0], True, 0),
              ScheduledChunk(f"b{step}", [4], 9 + step, [1, 2, 3], True, 2)]
    plan = Plan(step, chunks, block_ops=[BlockOp(BlockOpKind.SWAP_OUT, "c", 0, [5])],
                preempted=["c"])
    result = StepResult(step, [JobOutput("a", 7), JobOutput(f"b{step}", 8)], 0.02,
                        swaps_in_done=["d"])
    return Iteration(plan, result, [], 1.5 + step, 0, False)


def test_records_give_back_each_chunk_and_plan() -> None:
    stats = LoopStats()
    its = [_iteration(step) for step in range(3)]
    for it in its:
        stats.count_iteration(it, 0.03)
        trace = it.trace()
        assert trace is not None
        stats.add_plan(trace)
    assert stats.iteration_log() == [(((0, 3), (9 + s, 1)), 0.02, 0.03) for s in range(3)]
    assert stats.plans() == [StepTrace.of(it.planned_at, it.plan, it.result) for it in its]
    assert stats.plans()[1] == StepTrace(2.5, 1, ("a", "b1"), 4, (), ("c",), ("c",), ("d",),
                                         0.02)
    assert stats.trace()["plans"][2]["jobs"] == ("a", "b2")


def _tracked(obj: object) -> int:
    """How many objects the collector tracks in `obj` and the tuples in it."""
    inner = sum(_tracked(x) for x in obj) if isinstance(obj, tuple) else 0
    return int(gc.is_tracked(obj)) + inner


def test_a_record_keeps_a_few_objects_whatever_the_batch() -> None:
    # Each object a record keeps is a net allocation towards the next young
    # collection (engine/gc_heap.py): a busy loop's records must not set
    # its pace with one object per chunk.
    stats = LoopStats()
    chunks = [ScheduledChunk(f"j{i}", [4], 9 + i, [1], True, 2) for i in range(100)]
    it = Iteration(Plan(1, chunks), StepResult(1, [], 0.02), [], 1.0, 0, False)
    trace = it.trace()
    assert trace is not None
    stats.count_iteration(it, 0.03)
    stats.add_plan(trace)
    assert _tracked(stats.recent_iterations[0]) <= 3
    assert _tracked(stats.recent_plans[0]) <= 3
    assert len(stats.iteration_log()[0][0]) == 100


def test_plan_records_are_let_go_by_the_collector() -> None:
    # A record object would be walked by every full collection for as long
    # as the replica keeps it (50,000 plans); a tuple of plain values and
    # such tuples is dropped from the collector's lists, the tuples it holds
    # at one collection and itself at the next: before the oldest generation.
    stats = LoopStats()
    for step in range(50):
        it = _iteration(step)
        stats.count_iteration(it, 0.03)
        trace = it.trace()
        assert trace is not None
        stats.add_plan(trace)
    gc.collect()
    gc.collect()
    assert not any(gc.is_tracked(r) for r in stats.recent_plans)
    assert not any(gc.is_tracked(r) for r in stats.recent_iterations)
    assert gc.is_tracked(stats.plans()[0])  # what each record object would be
