"""Plan traces: one record per plan, and the counts that compare two runs."""

from __future__ import annotations

from scheduler.plan import BlockOp, BlockOpKind, Plan, ScheduledChunk, StepResult
from scheduler.trace import StepTrace, summarize


def _chunk(jid: str, n: int = 1) -> ScheduledChunk:
    return ScheduledChunk(jid, [0] * n, 0, [0], True, 0)


def test_record_names_jobs_once_per_kind():
    plan = Plan(step=7, chunks=[_chunk("a", 3), _chunk("b")], preempted=["c"])
    plan.block_ops = [BlockOp(BlockOpKind.SWAP_OUT, "c", 0, [0, 1, 2])]
    plan.block_ops += [BlockOp(BlockOpKind.SWAP_IN, "d", 0, [10, 11])]
    plan.block_ops.append(BlockOp(BlockOpKind.DROP, "e", 0, []))
    rec = StepTrace.of(1.5, plan, StepResult(7, [], 0.25, swaps_in_done=["f"]))
    assert rec == StepTrace(1.5, 7, ("a", "b"), 4, ("d",), ("c",), ("c",), ("f",), 0.25)
    assert StepTrace(**rec.to_json()) == rec


def test_summary_counts_plans_swaps_and_pingpong():
    def t(at: float, jobs=(), ins=(), outs=(), pre=(), dt=0.1) -> StepTrace:
        return StepTrace(at, 0, tuple(jobs), len(jobs), tuple(ins), tuple(outs), tuple(pre),
                         (), dt if jobs else 0.0)

    trace = [
        t(0.0, jobs=["a", "b"], outs=["c"], pre=["c"]),
        t(0.1, ins=["c"]),                      # swap-only plan
        t(0.2),                                 # idle: waits on the copy
        t(0.3, jobs=["c"], outs=["a"], dt=0.3),
        t(0.6, jobs=["c"], outs=["c"]),         # out again 0.5 s after its swap-in
        t(2.0, ins=["a"]),
        t(3.5, jobs=["b"], outs=["a"]),         # 1.5 s after: not ping-pong at 1 s
    ]
    s = summarize(trace, pingpong_s=1.0)
    assert (s["plans"], s["computing_plans"], s["swap_only_plans"], s["idle_plans"]) == (7, 4, 2, 1)
    assert s["mean_batch"] == 5 / 4
    assert abs(s["mean_iteration_s"] - 0.6 / 4) < 1e-12
    assert (s["swap_ins"], s["swap_outs"], s["preempted_for_a_runner"]) == (2, 4, 1)
    assert (s["jobs_swapped_out"], s["max_swap_outs_one_job"]) == (2, 2)
    assert s["pingpong"] == 1
    assert summarize(trace, pingpong_s=2.0)["pingpong"] == 2


def test_only_plans_that_did_something_are_kept():
    idle = Plan(step=1)
    assert not StepTrace.eventful(idle, StepResult(1, [], 0.0))
    assert StepTrace.eventful(idle, StepResult(1, [], 0.0, swaps_in_done=["a"]))
    assert StepTrace.eventful(idle, StepResult(1, [], 0.0, swaps_in_failed=["a"]))
    assert StepTrace.eventful(Plan(step=2, chunks=[_chunk("a")]), StepResult(2, [], 0.1))
    copy = Plan(step=3, block_ops=[BlockOp(BlockOpKind.DROP, "a", 0, [])])
    assert StepTrace.eventful(copy, StepResult(3, [], 0.0))
