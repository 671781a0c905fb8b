"""What a newcomer waits for under skip-join MLFQ, per queue it would join
(scheduler/policies/mlfq_admission.py), on a fake clock."""

from __future__ import annotations

from scheduler.policies.mlfq_admission import NewcomerLevel
from tests.scheduler.conftest import make_job
from tests.scheduler.test_mlfq import mlfq_core


def test_levels_count_the_jobs_above_and_their_work_until_demoted(clock):
    # q = 11, 22, 44, 88, 176, 352 ms; prefill(n) = 10 + n ms; a full
    # batch of 2 decodes in 12 ms, which each token costs a job's quantum.
    core = mlfq_core(clock, max_batch_size=2)
    pol = core.policy
    a, b, c = make_job(5, 4), make_job(5, 4), make_job(100, 4)
    for j in (a, b, c):
        core.add(j)
    assert [pol.level[j.job_id] for j in (a, b, c)] == [1, 1, 4]
    got = pol.newcomer_levels(core.batch, mean_output_len=50.0)
    # The longest prompt joining each queue (about 1, 12, 34, 78, 166
    # tokens: prefill within 11, 22, 44, 88, 176 ms), as the policy joins
    # them, up to the token budget's (256 tokens, 266 ms: q6), past which
    # no prompt is ever joined.
    longest = [lv.max_prompt_tokens for lv in got]
    assert longest[-1] == 256 and len(longest) == 6
    for lvl, n in enumerate(longest[:-1]):
        assert abs(n - [1, 12, 34, 78, 166][lvl]) <= 1
        assert pol._join_level(pol._join_work(make_job(n, 4))) == lvl
        assert pol._join_level(pol._join_work(make_job(n + 1, 4))) == lvl + 1
    assert [lv.jobs for lv in got] == [0, 2, 2, 2, 3, 3]
    # a and b: 9 tokens of work each (5 prompt, 4 answer), but only 22 ms
    # of quantum (1.8 tokens) in q2, 66 ms (5.5) through q3, 154 ms (all 9)
    # through q4; c: 104 tokens, 176 ms (14.7) in q5, 528 ms (44) through q6.
    assert [lv.ahead_tokens for lv in got] == [0, 3, 11, 18, 32, 62]
    # Once a and b run, the batch is full of q2 jobs: a newcomer joining q2
    # waits for them, but nothing of theirs is queued outside the batch.
    core.schedule()
    assert core.batch == {a.job_id, b.job_id}
    got = pol.newcomer_levels(core.batch, mean_output_len=50.0)
    assert [lv.jobs for lv in got] == [0, 2, 2, 2, 3, 3]
    assert [lv.ahead_tokens for lv in got] == [0, 0, 0, 0, 14, 44]


def test_used_quantum_and_expected_output_bound_the_work(clock):
    core = mlfq_core(clock, max_batch_size=2)
    pol = core.policy
    short = make_job(5, 1000)
    core.add(short)
    pol.used[short.job_id] = 0.016  # of q2's 22 ms: 6 ms (0.5 token) left
    [_, q2, q3, *_] = pol.newcomer_levels(set(), mean_output_len=50.0)
    assert (q2.ahead_tokens, q3.ahead_tokens) == (0, 4)  # 0.5, then (6 + 44) / 12
    # Through q6: (6 + 44 + 88 + 176 + 352) ms / 12 ms = 55.5 tokens of
    # quantum, more than its work: 5 prompt tokens and the mean answer, 50.
    bottom = pol.newcomer_levels(set(), mean_output_len=50.0)[-1]
    assert bottom == NewcomerLevel(256, 1, 55)


def test_only_skip_join_reports_levels(clock):
    from scheduler.config import SchedulerConfig
    from scheduler.core import SchedulerCore

    assert mlfq_core(clock, policy="mlfq-naive").policy.newcomer_levels(set(), 50.0) is None
    fcfs = SchedulerCore(SchedulerConfig(policy="fcfs", block_size=4, num_blocks=16,
                                         max_model_len=64), clock)
    assert fcfs.policy.newcomer_levels(set(), 50.0) is None


def test_the_replicas_report_carries_the_levels_to_placement(clock):
    from scheduler.admission import AdmissionBound, load_report
    from scheduler.placement import Placement
    from tests.scheduler.test_mlfq import COST

    core = mlfq_core(clock, max_batch_size=2)
    for _ in range(3):
        core.add(make_job(5, 4))
    core.schedule()  # two run; the third waits in q2
    levels = core.policy.newcomer_levels(core.batch, 50.0)
    jobs = list(core.jobs.values())
    # Not asked for (`admission.per_queue_wait` off): neither levels nor bound.
    plain = load_report(jobs, core.batch, 50.0, 100.0, AdmissionBound(2.0), 2, 256, COST,
                        levels=levels)
    assert "levels" not in plain and "backlog_capacity_tokens" not in plain
    report = load_report(jobs, core.batch, 50.0, 100.0, AdmissionBound(2.0, max_backlog_s=10.0),
                         2, 256, COST, levels=levels)
    assert report["backlog_capacity_tokens"] == 10.0 * 100.0  # max_backlog_s at 100 tokens/s
    p = Placement()
    p.report("r", 64, 64, 0, 3, now=0.0, **report)
    r = p.replicas["r"]
    assert r.levels == [[lv.max_prompt_tokens, lv.jobs, lv.ahead_tokens] for lv in levels]
    assert r.levels[1][1:] == [3, 1]  # three jobs up to q2; the waiting one's 1.8 tokens there
    # A newcomer joining q2 finds the batch full of q2 jobs: it waits.
    assert r.ttft_s(5) > r.ttft_s(1)
