import pytest

from scheduler.placement import Placement


def test_places_on_least_pressured_and_counts_burst():
    p = Placement()
    p.report("a", num_blocks=100, free_blocks=50, queued_tokens=500, num_jobs=3, now=0.0)
    p.report("b", num_blocks=100, free_blocks=90, queued_tokens=100, num_jobs=1, now=0.0)
    # Pressure = (queued + placed since report) / blocks: a 5.0, b 1.0.
    assert p.place("j1", tokens=300, now=0.1) == "b"  # b -> 4.0
    assert p.place("j2", tokens=300, now=0.1) == "b"  # b -> 7.0
    assert p.place("j3", tokens=300, now=0.1) == "a"  # burst spills over
    # A fresh report resets what was counted since the last one.
    p.report("b", num_blocks=100, free_blocks=90, queued_tokens=0, num_jobs=0, now=0.2)
    assert p.place("j4", tokens=10, now=0.3) == "b"

def test_stale_replicas_are_dropped_and_none_without_replicas():
    p = Placement(stale_after_s=1.0)
    assert p.place("j", 10, now=0.0) is None
    p.report("a", 10, 10, 0, 0, now=0.0)
    assert p.place("j", 10, now=0.5) == "a"
    assert p.place("k", 10, now=2.0) is None
    p.release("j")
    assert "j" not in p.job_replica


def test_a_failed_replica_is_forgotten_until_it_reports_again():
    p = Placement()
    p.report("a", 100, 100, 0, 0, now=0.0)
    p.report("b", 100, 50, 500, 2, now=0.0)
    assert p.place("j", 10, now=0.1) == "a"
    p.forget("a")
    assert p.place("k", 10, now=0.1) == "b"
    p.forget("nobody")  # unknown ids are ignored
    p.report("a", 100, 100, 0, 0, now=0.2)
    assert p.place("m", 10, now=0.3) == "a"


def _report(p, rid, waiting, capacity, tps=100.0, now=0.0, mean_out=50.0):
    p.report(rid, num_blocks=100, free_blocks=100, queued_tokens=waiting, num_jobs=1, now=now,
             waiting_tokens=waiting, capacity_tokens=capacity, tokens_per_s=tps,
             mean_output_len=mean_out)


def test_admission_refuses_beyond_the_bound_with_the_wait_until_it_fits():
    p = Placement()
    _report(p, "a", waiting=150, capacity=200, tps=10.0)
    # 10 prompt + min(max_tokens, mean output 50) = 60 > 200 - 150.
    r = p.admit("j1", prompt_tokens=10, max_tokens=500, n=1, now=0.1)
    assert not r.admitted and r.replica is None
    assert r.retry_after_s == (150 + 60 - 200) / 10.0
    # A short answer still fits: the bound is on tokens, not requests.
    assert p.admit("j2", prompt_tokens=10, max_tokens=20, n=1, now=0.1).replica == "a"
    # What was admitted counts until the next report.
    assert not p.admit("j3", prompt_tokens=10, max_tokens=20, n=1, now=0.1).admitted
    _report(p, "a", waiting=0, capacity=200, tps=10.0, now=0.2)
    assert p.admit("j4", prompt_tokens=10, max_tokens=500, n=3, now=0.3).admitted


def test_an_idle_replica_admits_any_request_and_overflow_spills_to_another():
    p = Placement()
    _report(p, "a", waiting=0, capacity=100)
    big = p.admit("big", prompt_tokens=900, max_tokens=2000, n=1, now=0.1)
    assert big.admitted and big.replica == "a"
    _report(p, "b", waiting=0, capacity=100)
    # a now holds the big job's backlog; the next one goes to b.
    assert p.admit("j", prompt_tokens=10, max_tokens=10, n=1, now=0.1).replica == "b"


def test_no_bound_before_the_replica_measured_its_speed():
    from scheduler.admission import AdmissionBound

    assert AdmissionBound(2.0).capacity(None) == float("inf")
    assert AdmissionBound(2.0).capacity(150.0) == 300.0
    assert AdmissionBound(2.0, max_queued_tokens=64).capacity(150.0) == 64.0


def test_queued_work_counts_jobs_outside_the_batch_with_their_remaining_output():
    from scheduler.admission import MeanOutput, queued_work
    from scheduler.job import Job

    waiting = Job("w", [1] * 30, max_tokens=100, arrival_time=0.0)
    predicted = Job("p", [1] * 10, max_tokens=100, arrival_time=0.0, predicted_output_len=20)
    short = Job("s", [1] * 10, max_tokens=5, arrival_time=0.0)
    running = Job("r", [1] * 10, max_tokens=100, arrival_time=0.0)
    preempted = Job("x", [1] * 10, max_tokens=100, arrival_time=0.0)
    preempted.output_token_ids = [5] * 20
    outran = Job("o", [1] * 10, max_tokens=100, arrival_time=0.0)
    outran.output_token_ids = [5] * 80
    jobs = [waiting, predicted, short, running, preempted, outran]
    # 30 + 50 (mean) | 10 + 20 (predicted) | 10 + 5 (max_tokens) | in the
    # batch: 0 | preempted: 30 tokens to recompute + (50 - 20) of its output
    # | past the mean: 90 to recompute + 0.6 x 50, but 20 left to max_tokens.
    assert queued_work(jobs, {"r"}, mean_output_len=50) == 80 + 30 + 15 + 0 + 60 + 110
    outran.max_tokens = 1000
    assert queued_work([outran], set(), mean_output_len=50) == 90 + 30

    mean = MeanOutput(initial=256)
    for n in (10, 10, 10):
        mean.add(n)
    assert mean.value == 10  # the first samples replace the prior
    for _ in range(200):
        mean.add(100)
    assert 95 < mean.value <= 100


def test_offline_work_is_outside_the_bound_only_under_co_serving():
    from scheduler.admission import bounded

    assert not bounded("offline", "conserve")
    assert bounded("online", "conserve")
    # Elsewhere offline jobs run beside online ones and delay them alike.
    assert bounded("offline", "fcfs") and bounded("offline", "mlfq")


def _prefill(prefill_tokens=0, decodes=0, jobs=0, batch=4, budget=100, slowdown=1.0):
    return {"prefill_tokens": prefill_tokens, "decodes": decodes, "jobs": jobs,
            "max_batch_size": batch, "max_batch_tokens": budget, "base_s": 0.1,
            "per_token_s": 0.01, "per_seq_s": 0.02, "slowdown": slowdown}


def _report_prefill(p, rid, slo=2.0, now=0.0, waiting=0, tps=100.0, arrived=None, levels=None,
                    backlog=float("inf"), **kw):
    p.report(rid, num_blocks=100, free_blocks=100, queued_tokens=0, num_jobs=kw.get("jobs", 0),
             now=now, waiting_tokens=waiting, capacity_tokens=0.0, tokens_per_s=tps,
             mean_output_len=50.0, prefill=_prefill(**kw), ttft_slo_s=slo, arrived=arrived,
             levels=levels, backlog_capacity_tokens=backlog)


def test_ttft_estimate_counts_iterations_at_the_token_budget_beside_the_decodes():
    from scheduler.admission import PrefillLoad, ttft_estimate

    load = PrefillLoad(**_prefill(prefill_tokens=150, decodes=2))
    # 150 ahead + 50 own = 200 prompt tokens at 98 a step: 3 steps, one more
    # under way; each step 0.1 + 2 * 0.02; the tokens 200 * 0.01.
    assert ttft_estimate(load, 50) == pytest.approx(4 * 0.14 + 2.0)
    # Placed since the report: more prompt ahead, more decodes riding along.
    # 300 tokens at 97 a step: 4 steps and the one under way, 0.1 + 3 * 0.02.
    assert ttft_estimate(load, 50, ahead_tokens=100, extra_jobs=1) == pytest.approx(
        5 * 0.16 + 3.0)
    slow = PrefillLoad(**_prefill(prefill_tokens=150, decodes=2, slowdown=1.5))
    assert ttft_estimate(slow, 50) == pytest.approx(1.5 * ttft_estimate(load, 50))


def test_prefill_load_separates_prompt_work_from_decodes():
    from scheduler.admission import prefill_load
    from scheduler.cost import LinearCost
    from scheduler.job import Job

    fresh = Job("f", [1] * 30, max_tokens=10, arrival_time=0.0)
    half = Job("h", [1] * 30, max_tokens=10, arrival_time=0.0)
    half.num_computed_tokens = 20
    decoding = Job("d", [1] * 10, max_tokens=10, arrival_time=0.0)
    decoding.output_token_ids = [5, 6]
    decoding.num_computed_tokens = 11
    recompute = Job("r", [1] * 10, max_tokens=10, arrival_time=0.0)
    recompute.output_token_ids = [5, 6, 7]
    load = prefill_load([fresh, half, decoding, recompute], 8, 64,
                        LinearCost(0.1, 0.01, 0.02), slowdown=1.2)
    # 30 + 10 to prefill; the decoding job's last token is its next input;
    # the preempted one recomputes 12 of its 13 tokens before decoding.
    assert load.prefill_tokens == 30 + 10 + 0 + 12
    assert (load.decodes, load.jobs, load.slowdown) == (2, 4, 1.2)
    assert (load.base_s, load.per_token_s, load.per_seq_s) == (0.1, 0.01, 0.02)


def test_ttft_admission_admits_a_burst_into_free_slots_until_the_objective():
    p = Placement()
    _report_prefill(p, "a", batch=8)
    # Each 30-token prompt adds 0.3 s of tokens and a job riding along
    # (0.02 s a step): estimates 0.5, 0.84, 1.18, 1.68 s, then 2.04 s > 2 s.
    got = [p.admit(f"j{i}", prompt_tokens=30, max_tokens=500, n=1, now=0.1)
           for i in range(5)]
    assert [r.admitted for r in got] == [True, True, True, True, False]
    assert got[4].retry_after_s == pytest.approx(0.5)  # 0.04 s over, at least 0.5
    # A report with those prompts computed frees the room again.
    _report_prefill(p, "a", now=0.2, decodes=4, jobs=4, batch=8)
    assert p.admit("k", prompt_tokens=30, max_tokens=500, n=1, now=0.3).admitted


def test_ttft_admission_starts_a_long_prompt_only_with_nothing_ahead():
    p = Placement()
    _report_prefill(p, "a", decodes=2, jobs=2)
    # 500 prompt tokens: 5 s alone, over the 2 s objective, but nothing is
    # ahead and a slot is free: admitted.
    assert p.admit("long", prompt_tokens=500, max_tokens=10, n=1, now=0.1).admitted
    # Now its prompt is ahead of the next one.
    r = p.admit("next", prompt_tokens=10, max_tokens=10, n=1, now=0.1)
    assert not r.admitted and r.retry_after_s > 3.0
    # A full batch adds the queued output work at the measured speed:
    # 0.42 s of steps + 200 tokens at 100/s.
    _report_prefill(p, "a", now=0.2, decodes=4, jobs=4, waiting=200, tps=100.0)
    assert not p.admit("j", prompt_tokens=10, max_tokens=10, n=1, now=0.3).admitted
    _report_prefill(p, "a", now=0.4, decodes=3, jobs=3, waiting=200, tps=100.0)
    assert p.admit("j", prompt_tokens=10, max_tokens=10, n=1, now=0.5).admitted


def test_ttft_admission_prefers_the_replica_with_the_sooner_first_token():
    p = Placement()
    _report_prefill(p, "a", prefill_tokens=80, decodes=1, jobs=2)
    _report_prefill(p, "b", decodes=3, jobs=3)
    assert p.admit("j", prompt_tokens=20, max_tokens=10, n=1, now=0.1).replica == "b"


def test_jobs_in_transit_count_until_a_report_counts_them():
    """Under a burst an admitted request may reach its replica after the
    replica's next report: that report must not make it vanish, or the
    next admissions see a replica emptier than it is."""
    p = Placement()
    _report_prefill(p, "a", batch=8)
    first = [p.admit(f"j{i}", prompt_tokens=30, max_tokens=500, n=1, now=0.1).admitted
             for i in range(5)]
    assert first == [True, True, True, True, False]  # as without a report between
    # A report that took in only j0 (its prompt among its figures): the
    # three others still count.  A 40-token prompt: 160 tokens to prefill,
    # three steps of 0.16 s and 1.6 s of tokens, over the objective (0.9 s
    # had the report wiped the three).
    _report_prefill(p, "a", now=0.2, prefill_tokens=30, jobs=1, batch=8, arrived=["j0"])
    r = p.admit("k", prompt_tokens=40, max_tokens=500, n=1, now=0.3)
    assert not r.admitted and r.retry_after_s == pytest.approx(0.5)
    assert sorted(p.replicas["a"].in_transit) == ["j1", "j2", "j3"]
    # Once reported, each is counted by the report alone, not twice.
    _report_prefill(p, "a", now=0.4, decodes=4, jobs=4, batch=8, arrived=["j1", "j2", "j3"])
    a = p.replicas["a"]
    assert (a.in_transit, a.placed_jobs, a.placed_prefill, a.placed_tokens) == ({}, 0, 0, 0)
    assert p.admit("k", prompt_tokens=30, max_tokens=500, n=1, now=0.5).admitted


def test_a_job_never_reported_stops_counting_when_released_or_stale():
    p = Placement(stale_after_s=10.0)
    _report_prefill(p, "a", batch=8)
    assert p.admit("gone", prompt_tokens=30, max_tokens=500, n=1, now=0.1).admitted
    assert p.admit("lost", prompt_tokens=30, max_tokens=500, n=1, now=0.1).admitted
    # The client of `gone` left before its stream opened: released.
    p.release("gone")
    assert list(p.replicas["a"].in_transit) == ["lost"]
    # `lost` was never named by a report (a lost report): dropped after
    # the staleness window.
    _report_prefill(p, "a", now=5.0, batch=8, arrived=[])
    assert list(p.replicas["a"].in_transit) == ["lost"]
    _report_prefill(p, "a", now=10.2, batch=8, arrived=[])
    assert p.replicas["a"].in_transit == {} and p.replicas["a"].placed_jobs == 0


def test_under_mlfq_a_newcomer_waits_only_for_its_queue_and_those_above():
    p = Placement()
    # A full batch (4 of 4) and 400 tokens queued outside it: read as FCFS,
    # a newcomer waits for all of them: 2 steps of 0.16 s, 0.1 s of its
    # tokens, 4 s for the queue: refused.
    _report_prefill(p, "a", decodes=4, jobs=4, waiting=400, tps=100.0)
    r = p.admit("fcfs", prompt_tokens=10, max_tokens=10, n=1, now=0.1)
    assert not r.admitted and r.retry_after_s == pytest.approx(0.32 + 0.1 + 4.0 - 2.0)
    # Under MLFQ a 10-token prompt joins a queue that holds one job (with
    # those above it): it takes a slot from a job of a lower queue.
    levels = [[20, 1, 30], [100, 4, 300]]
    _report_prefill(p, "a", now=0.2, decodes=4, jobs=4, waiting=400, tps=100.0, levels=levels)
    assert p.admit("short", prompt_tokens=10, max_tokens=10, n=1, now=0.3).admitted
    # A 50-token prompt joins the second queue, which four jobs fill: it
    # waits for their 300 tokens there and the 20 just placed (3.2 s), after
    # the 10 placed prompt tokens and its own 50 (0.6 s).
    r = p.admit("mid", prompt_tokens=50, max_tokens=10, n=1, now=0.3)
    assert not r.admitted and r.retry_after_s == pytest.approx(0.32 + 0.6 + 3.2 - 2.0)
    # A prompt longer than any queue lists joins the last one.
    # (510 prompt tokens at 97 a step: 6 steps and the one under way.)
    assert p.replicas["a"].ttft_s(500) == pytest.approx(7 * 0.16 + 0.01 * 510 + 3.2)
    # Placed jobs count among the jobs above: once the first queue's job
    # and three placed fill the batch, a short prompt waits for the 30
    # tokens in it and the placed ones' (20 each): admitted while that
    # keeps it within 2 s (1.62, 1.92 s), refused at 2.22 s.
    assert [p.admit(f"s{i}", prompt_tokens=10, max_tokens=10, n=1, now=0.3).admitted
            for i in range(5)] == [True, True, True, True, False]
    assert p.replicas["a"].ttft_s(10) == pytest.approx(0.32 + 0.01 * 60 + (30 + 100) / 100)


def test_the_backlog_bound_refuses_what_the_estimate_would_admit():
    p = Placement()
    # Nobody in the queue a newcomer joins, so no wait for a slot, but 900
    # tokens queued outside the batch against a bound of 1,000.
    levels = [[100, 0, 0]]
    _report_prefill(p, "a", decodes=4, jobs=4, waiting=900, tps=100.0, levels=levels,
                    backlog=1000.0)
    # 10 prompt tokens + the mean answer (50): 960 <= 1000, admitted.
    assert p.admit("j1", prompt_tokens=10, max_tokens=500, n=1, now=0.1).admitted
    # 100 + 50 more would go 110 tokens over: 1.1 s at the measured speed.
    r = p.admit("j2", prompt_tokens=100, max_tokens=500, n=1, now=0.1)
    assert not r.admitted and r.retry_after_s == pytest.approx(1.1)
    # With nothing queued any request is admitted, however large.
    _report_prefill(p, "a", now=0.2, decodes=4, jobs=4, waiting=0, tps=100.0, levels=levels,
                    backlog=1000.0, arrived=["j1"])
    assert p.admit("big", prompt_tokens=50, max_tokens=5000, n=30, now=0.3).admitted
