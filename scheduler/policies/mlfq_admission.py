"""What a newcomer waits for under skip-join MLFQ, per queue it would join.

Admission estimates a newcomer's first token (scheduler/admission.py).
Under FCFS a newcomer that finds the batch full waits for every queued job
ahead of it.  Under MLFQ it skip-joins the highest queue whose quantum
covers its prefill (FastServe §4.1) and each iteration takes the highest
queues first, so it waits only for the jobs in its queue or above: with
fewer of them than the batch holds, it takes a slot from a job of a lower
queue at the next iteration, however much work waits down there.  And a
job up there holds its place only until it has used the quanta of the
queues down to the newcomer's: then it is demoted below it.

So for each queue a prompt can join the replica reports: the longest prompt
that joins it (prompts are chunked to `max_batch_tokens`, so the queues
past that prompt's are never joined), how many jobs are in it or above, and
the tokens those of them outside the batch will compute before they fall
below it: the least of their remaining work (`queued_work`'s guess) and the
iterations their remaining quanta down to that queue last, one token each.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.admission import remaining_output

if TYPE_CHECKING:
    from scheduler.policies.mlfq import MLFQPolicy


@dataclass(frozen=True)
class NewcomerLevel:
    # The longest prompt (tokens) that joins this queue.
    max_prompt_tokens: int
    # Jobs in this queue or above, in the batch or not.
    jobs: int
    # Tokens the jobs among them outside the batch compute before they
    # leave this queue and the ones above it.
    ahead_tokens: int


def newcomer_levels(policy: MLFQPolicy, batch: Collection[str],
                    mean_output_len: float) -> list[NewcomerLevel]:
    cost, cfg, quanta = policy.cost, policy.config, policy.quanta
    if cost is None:
        return []
    longest = cfg.max_batch_tokens
    reach = policy._join_level(cost.prefill_time(longest))
    # Seconds a job entering queue k spends in queues k..l (the newcomer's
    # l), as a prefix sum of the quanta.
    sums = [0.0]
    for q in quanta[: reach + 1]:
        sums.append(sums[-1] + q)
    # A full batch's iteration: what one token of a job costs its quantum.
    per_token = cost.decode_time(cfg.max_batch_size)
    jobs = [0] * (reach + 1)
    ahead = [0.0] * (reach + 1)
    # Snapshots (one call each): the replica reports from another thread
    # than the one that plans.
    for levels in list(policy._levels.values()):
        for lvl, queue in enumerate(levels[: reach + 1]):
            for job in list(queue.values()):
                jobs[lvl] += 1
                if job.job_id in batch:
                    continue
                work = job.num_uncomputed_tokens + remaining_output(job, mean_output_len)
                left_here = quanta[lvl] - policy.used.get(job.job_id, 0.0)
                for newcomer in range(lvl, reach + 1):
                    budget = left_here + sums[newcomer + 1] - sums[lvl + 1]
                    ahead[newcomer] += min(work, max(0.0, budget) / per_token)
    out: list[NewcomerLevel] = []
    above = 0
    for lvl in range(reach + 1):
        above += jobs[lvl]
        joins = longest if lvl == reach else _longest_joining(policy, quanta[lvl], longest)
        out.append(NewcomerLevel(joins, above, int(ahead[lvl])))
    return out


def _longest_joining(policy: MLFQPolicy, quantum: float, longest: int) -> int:
    """The longest prompt (at most `longest`) whose prefill fits `quantum`."""
    cost = policy.cost
    assert cost is not None
    if cost.prefill_time(longest) <= quantum:
        return longest
    return bisect.bisect_right(range(1, longest + 1), quantum, key=cost.prefill_time)
