"""The engine autoscaling policy on recorded load reports (fake clock)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from scheduler.autoscale import (
    AutoscaleSettings, ReplicaSignals, desired_replicas, replica_signals, tpot_ratio,
)

SETTINGS = AutoscaleSettings(enabled=True, min_replicas=1, max_replicas=4, upscale_at=0.5,
                             downscale_at=0.2, upscale_delay_s=5, downscale_delay_s=30)


def sig(ratio: float, kv: float = 0.3, online: int = 4, offline: int = 0,
        tpot: float = 0.0) -> ReplicaSignals:
    return ReplicaSignals(ratio, kv, online, offline, tpot)


def replay(reports: list[tuple[float, dict[str, ReplicaSignals]]], current: int = 1,
           settings: AutoscaleSettings = SETTINGS) -> list[int]:
    """Replicas wanted after each report; Serve starts or stops at once."""
    state: dict[str, Any] = {}
    out = []
    for now, signals in reports:
        current, state = desired_replicas(signals, current, settings, state, now)
        out.append(current)
    return out


def test_a_burst_scales_up_after_the_delay_to_bring_the_estimate_back() -> None:
    burst = {"a": sig(1.4)}
    # Seconds 0..4: pressure, but not for long yet; at 5 s: 1.4 / 0.5 -> 3.
    assert replay([(t, burst) for t in range(6)]) == [1, 1, 1, 1, 1, 3]


def test_a_blip_shorter_than_the_delay_does_not_scale() -> None:
    reports = [(0, {"a": sig(0.9)}), (3, {"a": sig(0.9)}), (4, {"a": sig(0.3)}),
               (8, {"a": sig(0.9)}), (12, {"a": sig(0.9)})]
    assert replay(reports) == [1, 1, 1, 1, 1]


def test_replicas_still_starting_count_as_capacity_not_load() -> None:
    # Two replicas wanted, one has reported: its load spreads over both.
    state: dict[str, Any] = {"hot_since": 0.0}
    wanted, _ = desired_replicas({"a": sig(0.9)}, 2, SETTINGS, state, 10.0)
    assert wanted == 2  # 0.9 over two is under 0.5: the starting one will do
    wanted, _ = desired_replicas({"a": sig(1.0)}, 2, SETTINGS, state, 10.0)
    assert wanted == 2  # exactly upscale_at with it counted: it will do too
    # Still above upscale_at with the starting replica counted: more at
    # once, not after it reports (the queue grows meanwhile).
    wanted, _ = desired_replicas({"a": sig(1.2)}, 2, SETTINGS, state, 10.0)
    assert wanted == 3  # 1.2 over two -> 2 * 0.6 / 0.5 = 2.4
    wanted, _ = desired_replicas({"a": sig(1.2), "b": sig(0.6)}, 2, SETTINGS, state, 10.0)
    assert wanted == 4  # average 0.9 over two -> 2 * 0.9 / 0.5 = 3.6
    # ... and only after the delay, as any scale-up.
    wanted, _ = desired_replicas({"a": sig(1.2)}, 2, SETTINGS, {"hot_since": 8.0}, 10.0)
    assert wanted == 2


def test_kv_pressure_with_online_work_scales_up() -> None:
    full = {"a": sig(0.1, kv=0.95, online=3)}
    assert replay([(0, full), (6, full)]) == [1, 2]
    # Full of offline work only: the replica just fills idle capacity.
    offline = {"a": sig(0.1, kv=0.95, online=0, offline=40)}
    assert replay([(0, offline), (6, offline)]) == [1, 1]


def test_scales_down_one_at_a_time_when_fewer_would_still_be_idle() -> None:
    quiet = {"a": sig(0.05), "b": sig(0.05), "c": sig(0.0, online=0)}
    reports = [(t, quiet) for t in (0, 10, 29, 30, 45, 60)]
    # 0.1/3 over 3 -> on 2 replicas 0.05: under 0.2 for 30 s -> 2; then
    # again 30 s later: on 1 replica 0.1 -> 1.
    assert replay(reports, current=3) == [3, 3, 3, 2, 2, 1]


def test_offline_backlog_does_not_hold_replicas_up() -> None:
    only_offline = {"a": sig(0.0, kv=0.6, online=0, offline=50),
                    "b": sig(0.0, kv=0.6, online=0, offline=50)}
    assert replay([(0, only_offline), (30, only_offline)], current=2) == [2, 1]


def test_load_that_one_replica_fewer_could_not_carry_keeps_them() -> None:
    # 0.15 average on two replicas is 0.3 on one: above downscale_at.
    steady = {"a": sig(0.15), "b": sig(0.15)}
    assert replay([(t, steady) for t in (0, 30, 60, 90)], current=2) == [2, 2, 2, 2]


def test_no_reports_holds_the_current_count() -> None:
    assert replay([(0, {}), (100, {})], current=2) == [2, 2]


def test_settings_are_checked() -> None:
    with pytest.raises(ValidationError, match="max_replicas must be >= min_replicas"):
        AutoscaleSettings(min_replicas=3, max_replicas=2)
    with pytest.raises(ValidationError, match="downscale_at must be below upscale_at"):
        AutoscaleSettings(upscale_at=0.3, downscale_at=0.4)
    with pytest.raises(ValidationError, match="upscale_delay"):
        AutoscaleSettings(upscale_delay_s=-1)


def test_signals_come_from_the_admission_figures() -> None:
    from scheduler.autoscale import replica_signals

    prefill = {"prefill_tokens": 1000, "decodes": 4, "jobs": 6, "max_batch_size": 8,
               "max_batch_tokens": 256, "base_s": 0.01, "per_token_s": 0.001,
               "per_seq_s": 0.002}
    busy = replica_signals({"prefill": prefill, "ttft_slo_s": 2.0}, 0.5, 6, 1, 256)
    idle = replica_signals({"prefill": {**prefill, "prefill_tokens": 0, "decodes": 0},
                            "ttft_slo_s": 2.0}, 0.0, 0, 0, 256)
    # 1,256 tokens at 252 a step: 5 steps + 1 under way at 0.018 s, plus
    # 1.256 s of tokens -> 1.364 s of 2.
    assert busy["ttft_ratio"] == pytest.approx(1.364 / 2)
    assert 0 < idle["ttft_ratio"] < 0.2 < busy["ttft_ratio"]
    assert (busy["kv_use"], busy["online_jobs"], busy["offline_jobs"]) == (0.5, 6, 1)
    bound = replica_signals({"waiting_tokens": 300, "capacity_tokens": 1200}, 0.1, 2, 0, 256)
    assert bound["ttft_ratio"] == 0.25
    assert replica_signals({"waiting_tokens": 300, "capacity_tokens": float("inf")},
                           0.1, 2, 0, 256)["ttft_ratio"] == 0.0


def test_decoding_slowed_towards_the_tpot_objective_scales_up_with_ttft_fine() -> None:
    # MLFQ kept TTFT low (0.1 of its objective) while TPOT went 90 % of the
    # way from a lone decode to its objective: 0.9 / 0.5 -> 2 replicas.
    slow = {"a": sig(0.1, tpot=0.9)}
    assert replay([(t, slow) for t in (0, 3, 6)]) == [1, 1, 2]
    # And a replica decoding slowly is not let go either.
    pair = {"a": sig(0.0, tpot=0.15), "b": sig(0.0, tpot=0.15)}
    assert replay([(t, pair) for t in (0, 30, 60)], current=2) == [2, 2, 2]
    idle = {"a": sig(0.0, tpot=0.05), "b": sig(0.0, tpot=0.0)}
    assert replay([(t, idle) for t in (0, 30)], current=2) == [2, 1]


def test_tpot_ratio_runs_from_a_lone_decode_to_the_objective() -> None:
    assert tpot_ratio([], 0.02, 0.06) == 0.0
    assert tpot_ratio([0.02, 0.02], 0.02, 0.06) == 0.0
    assert tpot_ratio([0.01], 0.02, 0.06) == 0.0  # faster than the estimate
    assert tpot_ratio([0.03, 0.05], 0.02, 0.06) == pytest.approx(0.5)
    assert tpot_ratio([0.08], 0.02, 0.06) == pytest.approx(1.5)
    # An objective below a lone decode: any decoding counts against it.
    assert tpot_ratio([0.02], 0.02, 0.01) == pytest.approx(2.0)
    metrics = replica_signals({}, 0.5, 3, 1, 256, tpot=0.7)
    assert ReplicaSignals.of(metrics) == ReplicaSignals(0.0, 0.5, 3, 1, 0.7)


def test_only_an_iteration_decoding_an_online_job_counts_for_tpot() -> None:
    from scheduler.autoscale import online_cadence
    from scheduler.job import Job, JobClass
    from scheduler.plan import Plan, ScheduledChunk

    def job(jid: str, cls: JobClass) -> Job:
        j = Job(job_id=jid, prompt_token_ids=[1, 2], max_tokens=4, arrival_time=0.0,
                job_class=cls)
        j.num_computed_tokens = 2
        return j

    jobs = {"on": job("on", JobClass.ONLINE), "off": job("off", JobClass.OFFLINE)}
    decode = lambda jid: ScheduledChunk(jid, [5], 2, [], True, 1)  # noqa: E731
    prefill = ScheduledChunk("new", [1, 2], 0, [], True, 0)
    assert online_cadence(Plan(1, [decode("off"), decode("on")]), jobs) == (True, True, 1.0)
    # The online job waits (a prefill jumped ahead, or offline work ran):
    # its gap goes on.
    assert online_cadence(Plan(1, [decode("off")]), jobs) == (False, True, 1.0)
    assert online_cadence(Plan(1, [prefill]), jobs) == (False, True, 1.0)
    # A batch job alone: no cadence at all.
    offline = {"off": jobs["off"]}
    assert online_cadence(Plan(1, [decode("off")]), offline) == (False, False, 1.0)
    assert online_cadence(Plan(1, [decode("gone")]), offline) == (False, False, 1.0)
    # Offline tokens co-serving adds count out: the online share of the
    # iteration's estimate (base 10 ms, 1 ms a decode, 0.1 ms a prompt token).
    from scheduler.cost import LinearCost

    cost = LinearCost(base_s=0.010, prefill_per_token_s=0.0001, decode_per_seq_s=0.001)
    chunk = ScheduledChunk("off2", list(range(100)), 0, [], True, 0)
    jobs["off2"] = job("off2", JobClass.OFFLINE)
    _, _, share = online_cadence(Plan(1, [decode("on"), decode("off"), chunk]), jobs, cost)
    assert share == pytest.approx(0.011 / 0.022)
    assert online_cadence(Plan(1, [decode("on")]), jobs, cost)[2] == 1.0


def test_under_conserve_only_online_jobs_kv_counts_as_use() -> None:
    from scheduler.autoscale import kv_use
    from scheduler.job import Job, JobClass

    def job(cls: JobClass, blocks: int) -> Job:
        j = Job(job_id=f"{cls.value}-{blocks}", prompt_token_ids=[1], max_tokens=1,
                arrival_time=0.0, job_class=cls)
        j.block_table = list(range(blocks))
        return j

    jobs = [job(JobClass.ONLINE, 10), job(JobClass.OFFLINE, 85)]
    # A backlog fills the cache; online work would take it back.
    assert kv_use(jobs, free_blocks=5, num_blocks=100, policy="conserve") == pytest.approx(0.10)
    assert kv_use(jobs, free_blocks=5, num_blocks=100, policy="fcfs") == pytest.approx(0.95)
    assert kv_use([], free_blocks=100, num_blocks=100, policy="conserve") == 0.0
