"""What each iteration decided, one record per plan.

The live engine loop and the simulator both write these, from the same
`Plan` and `StepResult`, so that a live run can be laid beside its
simulation and the first place where the two schedulers part ways found
(`python -m bench trace-summary`).  Plain data: no Ray, no torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, fields
from typing import Any, Iterable

from scheduler.plan import BlockOpKind, Plan, StepResult


@dataclass(slots=True, frozen=True)
class StepTrace:
    t: float  # scheduler clock when the plan was made
    step: int
    jobs: tuple[str, ...]  # jobs computed this iteration
    tokens: int
    swap_in: tuple[str, ...]  # jobs whose swap-in this plan issued
    swap_out: tuple[str, ...]  # jobs this plan swapped out (any reason)
    preempted: tuple[str, ...]  # of those, the ones evicted for a job that runs
    landed: tuple[str, ...]  # swap-ins reported landed by this result
    iteration_time: float

    @classmethod
    def of(cls, t: float, plan: Plan, result: StepResult) -> "StepTrace":
        ins = dict.fromkeys(op.job_id for op in plan.block_ops
                            if op.kind in (BlockOpKind.SWAP_IN, BlockOpKind.PREFETCH))
        outs = dict.fromkeys(op.job_id for op in plan.block_ops
                             if op.kind is BlockOpKind.SWAP_OUT)
        return cls(t, plan.step, tuple(c.job_id for c in plan.chunks), plan.num_tokens,
                   tuple(ins), tuple(outs), tuple(plan.preempted),
                   tuple(result.swaps_in_done), result.iteration_time)

    @staticmethod
    def eventful(plan: Plan, result: StepResult) -> bool:
        """Worth a record: the plan computed or copied something, or a copy
        landed.  A replica waiting on a swap-in re-plans every millisecond;
        those empty plans would flush the live trace and have no
        counterpart in the simulator, which jumps to the landing."""
        return not plan.is_empty or bool(result.swaps_in_done or result.swaps_in_failed)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def row(self) -> tuple[Any, ...]:
        """The fields as a plain tuple (`StepTrace(*row)` gives the record
        back): a tuple of strings, numbers and such tuples is one the
        garbage collector stops tracking, so a replica can keep tens of
        thousands of them without its full collections walking each."""
        return tuple([getattr(self, name) for name in _FIELDS])


_FIELDS = tuple(f.name for f in fields(StepTrace))


def summarize(trace: Iterable[StepTrace], pingpong_s: float = 1.0) -> dict[str, float]:
    """Counts that locate a divergence between two runs of one workload.

    `pingpong` counts swap-outs of a job within `pingpong_s` of its previous
    swap-in: the churn that wastes copies without moving anyone forward.
    """
    plans = computing = swap_only = 0
    n_in = n_out = n_pre = pingpong = 0
    batch = 0
    time_s = 0.0
    last_in: dict[str, float] = {}
    outs_per_job: Counter[str] = Counter()
    for r in trace:
        plans += 1
        if r.jobs:
            computing += 1
            batch += len(r.jobs)
            time_s += r.iteration_time
        elif r.swap_in or r.swap_out:
            swap_only += 1
        for j in r.swap_out:
            if j in last_in and r.t - last_in[j] < pingpong_s:
                pingpong += 1
            outs_per_job[j] += 1
        for j in r.swap_in:
            last_in[j] = r.t
        n_in += len(r.swap_in)
        n_out += len(r.swap_out)
        n_pre += len(r.preempted)
    return {
        "plans": plans,
        "computing_plans": computing,
        "idle_plans": plans - computing - swap_only,
        "swap_only_plans": swap_only,
        "mean_batch": batch / computing if computing else 0.0,
        "mean_iteration_s": time_s / computing if computing else 0.0,
        "swap_ins": n_in,
        "swap_outs": n_out,
        "preempted_for_a_runner": n_pre,
        "jobs_swapped_out": len(outs_per_job),
        "max_swap_outs_one_job": max(outs_per_job.values(), default=0),
        "pingpong": pingpong,
    }
