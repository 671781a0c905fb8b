"""The simulator on tiny workloads with hand-checkable schedules."""

from __future__ import annotations

from typing import Any

import pytest

from bench.costmodel import AnalyticCostModel, BatchShape
from bench.metrics import summarize
from bench.records import RequestRecord
from bench.simulator import SimOptions, SimulationError, VirtualClock, measure_capacity, simulate
from bench.workload import ArrivalSpec, LengthSpec, RequestSpec, StreamSpec, WorkloadSpec, build_workload
from scheduler.config import SchedulerConfig


class UnitCost:
    """Every iteration takes 1 s (plus 0.5 s per swapped block)."""

    name = "unit"

    def iteration_time(self, shape: BatchShape) -> float:
        return 1.0

    def swap_time(self, num_blocks: int) -> float:
        return 0.5 * num_blocks

    def describe(self) -> dict[str, Any]:
        return {"kind": "unit"}


def sc(**kw: Any) -> SchedulerConfig:
    base: dict[str, Any] = dict(num_blocks=64, block_size=4, max_batch_size=8,
                                max_batch_tokens=8, max_model_len=64)
    base.update(kw)
    return SchedulerConfig(**base)


def r(rid: str, t: float, p: int, o: int) -> RequestSpec:
    return RequestSpec(request_id=rid, arrival_time=t, prompt_tokens=p, output_tokens=o)


def by_id(out):
    return {x.request_id: x for x in out.records}


def test_batched_schedule_by_hand():
    # A arrives at 0 (4 prompt, 3 out), B at 0.5 (4 prompt, 2 out).
    # it1 [0,1]: A prefill -> A tok1 @1.  B arrived meanwhile.
    # it2 [1,2]: A decode + B prefill (1 + 4 <= 8 tokens) -> A tok2, B tok1 @2.
    # it3 [2,3]: A decode + B decode -> A tok3 (done), B tok2 (done) @3.
    out = simulate([r("A", 0.0, 4, 3), r("B", 0.5, 4, 2)], sc(), UnitCost())
    a, b = by_id(out)["A"], by_id(out)["B"]
    assert a.token_times == [1.0, 2.0, 3.0] and a.end_time == 3.0
    assert b.token_times == [2.0, 3.0] and b.end_time == 3.0
    assert (a.output_tokens, b.output_tokens) == (3, 2)
    assert a.execution_time == 3.0 and a.queueing_time == 0.0
    # B waited 0.5 s for the iteration boundary, then ran 2 iterations.
    assert b.execution_time == 2.0 and b.queueing_time == pytest.approx(0.5)
    assert out.stats.iterations == 3 and out.end_time == 3.0
    s = summarize(out.records)
    assert s.ttft.mean == pytest.approx((1.0 + 1.5) / 2)
    assert s.e2e.mean == pytest.approx((3.0 + 2.5) / 2)
    assert s.breakdown.queueing_share == pytest.approx(0.5 / 5.5)


def test_fcfs_head_of_line_blocking_by_hand():
    # Batch of one: B (arrives 0.5) waits for all of A.
    # A: prefill @1, decodes @2, @3.  B: prefill @4, decode @5.
    out = simulate([r("A", 0.0, 4, 3), r("B", 0.5, 4, 2)], sc(max_batch_size=1), UnitCost())
    a, b = by_id(out)["A"], by_id(out)["B"]
    assert a.token_times == [1.0, 2.0, 3.0]
    assert b.token_times == [4.0, 5.0]
    assert b.ttft == pytest.approx(3.5)
    assert b.queueing_time == pytest.approx(2.5) and b.execution_time == 2.0
    s = summarize(out.records)
    assert s.tpot.mean == pytest.approx(1.0)
    assert s.normalized_latency.mean == pytest.approx((3.0 / 3 + 4.5 / 2) / 2)


def test_chunked_prefill_and_idle_jump():
    # A 10-token prompt with an 8-token budget takes two iterations; C
    # arrives at t=10 when the system is idle, the clock jumps there.
    out = simulate([r("A", 0.0, 10, 1), r("C", 10.0, 2, 2)], sc(), UnitCost())
    a, c = by_id(out)["A"], by_id(out)["C"]
    assert a.token_times == [2.0]
    assert c.token_times == [11.0, 12.0]
    assert c.queueing_time == 0.0


def test_recompute_preemption_and_accounting():
    # 6 blocks of 4 tokens = 24 tokens of KV; three jobs growing to 12 tokens
    # each cannot all stay: FCFS drops the newest and recomputes it later.
    reqs = [r(f"j{i}", 0.0, 4, 8) for i in range(3)]
    out = simulate(reqs, sc(num_blocks=16, max_model_len=16), UnitCost())
    assert all(x.ok for x in out.records)
    out2 = simulate(reqs, sc(num_blocks=6, max_model_len=16, max_batch_tokens=16), UnitCost())
    recs = out2.records
    assert all(x.ok and x.output_tokens == 8 for x in recs)
    assert sum(x.num_preemptions for x in recs) == out2.stats.num_preemptions > 0
    for x in recs:
        assert x.queueing_time + x.execution_time == pytest.approx(x.e2e)


def test_rejected_and_deterministic():
    reqs = [r("big", 0.0, 64, 1), r("ok", 0.0, 3, 2)]
    out = simulate(reqs, sc(), UnitCost())
    big = by_id(out)["big"]
    assert big.error is not None and big.error.startswith("rejected")
    assert by_id(out)["ok"].ok


def test_iteration_bound():
    with pytest.raises(SimulationError):
        simulate([r("A", 0.0, 4, 40)], sc(), UnitCost(), SimOptions(max_iterations=5))


def test_virtual_clock():
    c = VirtualClock(2.0)
    assert c() == 2.0
    c.now = 3.5
    assert c() == 3.5


def test_paper_scale_thousands_of_requests():
    cost = AnalyticCostModel.preset("opt-13b", "a100-80gb")
    config = SchedulerConfig(num_blocks=cost.num_kv_blocks(), block_size=16, max_batch_size=256,
                             max_batch_tokens=2048, max_model_len=2048)
    spec = WorkloadSpec(seed=0, streams=[StreamSpec(
        num_requests=1000, lengths=LengthSpec(dataset="fixed", input_len=100, output_len=50),
        arrivals=ArrivalSpec(rate=20.0))])
    wl = build_workload(spec)
    out = simulate(wl.requests, config, cost)  # its speed: `python -m bench.plan_time`
    assert all(x.ok for x in out.records)
    s = summarize(out.records)
    # Decode iterations of OPT-13B on an A100 take tens of ms (weights read).
    assert 0.015 < s.tpot.median < 0.06
    again = simulate(wl.requests, config, cost)
    assert [x.token_times for x in again.records] == [x.token_times for x in out.records]
    cap = measure_capacity(wl.requests, config, cost)
    assert cap > 20.0  # a 20 req/s stream of these short jobs is under capacity


def _three_jobs_in_six_blocks() -> tuple[list[RequestSpec], SchedulerConfig]:
    """Three 4 + 8-token jobs and KV room for two: one must be swapped."""
    if "swap_mode" not in SchedulerConfig.model_fields:
        pytest.skip("scheduler without KV swapping")
    reqs = [r(f"j{i}", 0.0, 4, 8) for i in range(3)]
    config = sc(num_blocks=6, max_model_len=16, max_batch_tokens=16, swap_mode="reactive",
                host_kv_blocks=64)
    return reqs, config


def test_reactive_swapping_accounting():
    reqs, config = _three_jobs_in_six_blocks()
    out = simulate(reqs, config, UnitCost())
    assert all(x.ok and x.output_tokens == 8 for x in out.records)
    assert out.stats.swap_blocks > 0
    assert sum(x.swap_time for x in out.records) > 0
    for x in out.records:
        assert x.queueing_time + x.execution_time + x.swap_time == pytest.approx(x.e2e)
    # Copies on a side stream hide under a 1 s iteration: less time, same tokens.
    hidden = simulate(reqs, config, UnitCost(), SimOptions(overlap_swap=True))
    assert hidden.end_time < out.end_time
    assert [x.output_tokens for x in hidden.records] == [8, 8, 8]


def test_swap_in_side_lane_by_hand():
    """Reactive: copies on the critical path.  Overlap: swap-ins land after
    their own copy time on the host -> device lane, the batch never waits for
    them, and an idle engine jumps to the landing."""
    reqs, config = _three_jobs_in_six_blocks()
    # Critical path: it6 [5,7] swaps j2's 2 blocks out (1 s) while j0, j1
    # decode; j0, j1 finish at 9; it9 [9,11] swaps j2 back in (1 s of copy
    # plus UnitCost's 1 s for any plan); j2 decodes from 11.
    out = simulate(reqs, config, UnitCost())
    j = by_id(out)
    assert j["j0"].token_times == [1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 8.0, 9.0]
    assert j["j2"].token_times == [1.0, 2.0, 3.0, 4.0, 5.0, 12.0, 13.0, 14.0]
    assert j["j0"].swap_time == pytest.approx(1.0)
    assert j["j2"].swap_time == pytest.approx(2.0)  # issue at 9, landed at 11
    assert out.stats.exposed_swap_time == pytest.approx(2.0)
    # Side lanes: the swap-out hides under the 1 s forward pass; j0, j1
    # finish at 8; j2's swap-in (2 x 0.5 s) is issued at 8 and lands at 9.
    out = simulate(reqs, config, UnitCost(), SimOptions(overlap_swap=True))
    j = by_id(out)
    assert j["j0"].token_times == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert j["j2"].token_times == [1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 11.0, 12.0]
    assert j["j0"].swap_time == 0.0
    assert j["j2"].swap_time == pytest.approx(1.0)  # issue at 8, landed at 9
    assert out.stats.exposed_swap_time == 0.0
    assert out.stats.swap_in_lane_busy == pytest.approx(1.0)
    for x in out.records:
        assert x.queueing_time + x.execution_time + x.swap_time == pytest.approx(x.e2e)


def test_trace_has_one_record_per_plan():
    """The side-lane schedule above, as its plan trace."""
    reqs, config = _three_jobs_in_six_blocks()
    out = simulate(reqs, config, UnitCost(), SimOptions(overlap_swap=True, trace=True))
    trace = out.trace
    assert [r.step for r in trace] == list(range(1, len(trace) + 1))
    assert len(trace) == out.stats.iterations  # (no plan here waited idle on a copy)
    outs = [r for r in trace if r.swap_out]
    ins = [r for r in trace if r.swap_in]
    assert [(r.t, r.swap_out, r.preempted) for r in outs] == [(5.0, ("j2",), ("j2",))]
    # Issued at 8 by a plan that computes nothing, reported landed by it at 9.
    assert [(r.t, r.jobs, r.swap_in, r.landed) for r in ins] == [(8.0, (), ("j2",), ("j2",))]
    assert simulate(reqs, config, UnitCost(), SimOptions(overlap_swap=True)).trace == []


def test_slo_abort_is_a_lower_bound():
    from bench.simulator import SLOAbort

    # Batch of one, 20 jobs of 10 tokens at t=0: the last waits ~190 s.
    reqs = [r(f"j{i}", 0.0, 2, 10) for i in range(20)]
    full = simulate(reqs, sc(max_batch_size=1), UnitCost())
    mean_nl = summarize(full.records).normalized_latency.mean
    with pytest.raises(SLOAbort) as e:
        simulate(reqs, sc(max_batch_size=1), UnitCost(),
                 SimOptions(abort_mean_normalized_latency=mean_nl / 2))
    assert mean_nl / 2 < e.value.bound <= mean_nl
    # A threshold the run meets never aborts.
    again = simulate(reqs, sc(max_batch_size=1), UnitCost(),
                     SimOptions(abort_mean_normalized_latency=mean_nl * 1.01))
    assert [x.token_times for x in again.records] == [x.token_times for x in full.records]


def test_idle_engine_waits_for_swap_in_landing():
    """A plan of swap-ins alone costs no compute: the engine idles until the
    copy lands (the clock jumps there), then runs the job."""
    if "swap_mode" not in SchedulerConfig.model_fields:
        pytest.skip("scheduler without KV swapping")

    class TokenCost(UnitCost):
        def iteration_time(self, shape: BatchShape) -> float:
            return 1.0 if shape.num_tokens else 0.0

    reqs = [r(f"j{i}", 0.0, 4, 8) for i in range(3)]
    config = sc(num_blocks=6, max_model_len=16, max_batch_tokens=16, swap_mode="reactive",
                host_kv_blocks=64)
    out = simulate(reqs, config, TokenCost(), SimOptions(overlap_swap=True))
    j2 = by_id(out)["j2"]
    # Swap-in issued at 8 by a compute-free plan, lands at 9.
    assert j2.token_times == [1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 11.0, 12.0]
    assert j2.swap_time == pytest.approx(1.0)
    out = simulate(reqs, config, TokenCost())
    j2 = by_id(out)["j2"]
    # Critical path: the swap-out stalls it6 by 1 s, the swap-in plan [9,10].
    assert j2.token_times == [1.0, 2.0, 3.0, 4.0, 5.0, 11.0, 12.0, 13.0]


def test_mlfq_proactive_beats_fcfs_and_hides_its_swaps():
    """Paper scale, past FCFS saturation (OPT-13B, A100-40GB, ShareGPT-like
    skew): skip-join MLFQ with proactive swapping keeps short jobs fast and
    preempts less than FCFS does, its swap copies hidden behind compute."""
    cost = AnalyticCostModel.preset("opt-13b", "a100-40gb")
    spec = WorkloadSpec(seed=0, streams=[StreamSpec(
        num_requests=300, lengths=LengthSpec(dataset="fixed", input_len=64, output_len=64),
        arrivals=ArrivalSpec(rate=12.0))])
    reqs = build_workload(spec).requests
    rng = __import__("random").Random(0)
    # Skewed outputs: most short, a few very long (the head-of-line case).
    reqs = [x.model_copy(update={"output_tokens": rng.choice([16, 16, 32, 64, 1200])})
            for x in reqs]
    base = dict(num_blocks=cost.num_kv_blocks(), block_size=16, max_batch_size=256,
                max_batch_tokens=2048, max_model_len=2048, host_kv_blocks=100_000)
    fcfs = simulate(reqs, SchedulerConfig(policy="fcfs", swap_mode="reactive", **base), cost)
    mlfq = simulate(reqs, SchedulerConfig(policy="mlfq", swap_mode="proactive", **base), cost,
                    SimOptions(overlap_swap=True))
    assert all(x.ok for x in mlfq.records)
    f, m = summarize(fcfs.records), summarize(mlfq.records)
    assert m.normalized_latency.mean < f.normalized_latency.mean
    assert m.ttft.p99 < f.ttft.p99
    # Fewer preemptions than FCFS's (127 against 326 when written), and the
    # copies of its twice as many swapped blocks off the critical path.
    assert 0 < mlfq.stats.num_preemptions < fcfs.stats.num_preemptions
    assert mlfq.stats.swap_blocks > 0
    assert mlfq.stats.exposed_swap_time < 0.01 * mlfq.stats.busy_time
    assert mlfq.stats.exposed_swap_time < 0.1 * fcfs.stats.exposed_swap_time


def test_a_capped_request_ends_at_its_length_unknown_to_the_scheduler():
    # max_tokens 40 is only the client's cap: the answer ends after 3
    # tokens, by end-of-sequence, and the job's KV is freed then.
    spec = RequestSpec(request_id="A", arrival_time=0.0, prompt_tokens=4, output_tokens=3,
                       max_tokens=40)
    out = simulate([spec], sc(), UnitCost())
    a = by_id(out)["A"]
    assert a.token_times == [1.0, 2.0, 3.0] and a.output_tokens == 3


def test_replayed_predictions_reach_the_jobs_padded():
    from scheduler.policies.econoserve import EconoservePolicy

    seen: dict[str, tuple[int | None, int | None]] = {}
    add = EconoservePolicy.add

    def spy(self, job):  # type: ignore[no-untyped-def]
        seen[job.job_id] = (job.predicted_output_len, job.allocated_output_len)
        add(self, job)

    EconoservePolicy.add = spy  # type: ignore[method-assign]
    try:
        reqs = [RequestSpec(request_id="A", arrival_time=0.0, prompt_tokens=4, output_tokens=9,
                            max_tokens=40, predicted_output_tokens=10),
                RequestSpec(request_id="B", arrival_time=0.0, prompt_tokens=4, output_tokens=5)]
        out = simulate(reqs, sc(policy="econoserve"), UnitCost(), SimOptions(padding_ratio=0.5))
    finally:
        EconoservePolicy.add = add  # type: ignore[method-assign]
    assert seen == {"A": (10, 15), "B": (None, None)}
    assert [x.output_tokens for x in out.records] == [9, 5]
    assert out.stats.as_dict()["econoserve_gts_admitted"] >= 2


def test_a_delayed_prediction_lands_between_iterations_after_its_delay():
    """Live, the predictor answers beside the prompt's computation: a
    recorded delay (or `SimOptions.prediction_delay_s`) keeps the job without
    its prediction until then."""
    from scheduler.policies.econoserve import EconoservePolicy

    landed: dict[str, tuple[float, int | None]] = {}
    on_prediction = EconoservePolicy.on_prediction

    def spy(self, job):  # type: ignore[no-untyped-def]
        landed[job.job_id] = (self.clock(), job.allocated_output_len)
        on_prediction(self, job)

    def run(opts: SimOptions, delay: float | None) -> tuple[dict[str, RequestRecord], dict]:
        landed.clear()
        reqs = [RequestSpec(request_id="A", arrival_time=0.0, prompt_tokens=4, output_tokens=9,
                            predicted_output_tokens=10, prediction_delay_s=delay),
                RequestSpec(request_id="B", arrival_time=0.5, prompt_tokens=4, output_tokens=5,
                            predicted_output_tokens=6, prediction_delay_s=delay)]
        out = simulate(reqs, sc(policy="econoserve"), UnitCost(), opts)
        return {r.request_id: r for r in out.records}, dict(landed)

    EconoservePolicy.on_prediction = spy  # type: ignore[method-assign]
    try:
        recs, seen = run(SimOptions(padding_ratio=0.5), 2.5)
        # A's lands at the first iteration boundary at or after 2.5 s (UnitCost:
        # one second an iteration), B's at or after 3.0 s.
        assert seen == {"A": (3.0, 15), "B": (3.0, 9)}
        assert recs["A"].prediction_delay_s == 3.0 and recs["B"].prediction_delay_s == 2.5
        # Predictions on arrival: nothing lands later, nothing to record.
        recs, seen = run(SimOptions(), None)
        assert seen == {} and recs["A"].prediction_delay_s is None
        # The option overrides every recorded delay.
        recs, seen = run(SimOptions(prediction_delay_s=0.0), 2.5)
        assert seen == {} and recs["B"].predicted_output_tokens == 6
        recs, seen = run(SimOptions(prediction_delay_s=1.0), None)
        assert set(seen) == {"A", "B"} and recs["A"].prediction_delay_s == 1.0
    finally:
        EconoservePolicy.on_prediction = on_prediction  # type: ignore[method-assign]


def test_a_shared_system_prompt_is_prefilled_once_with_the_prefix_cache():
    """The workload's shared prefix reaches the simulated scheduler as equal
    leading token ids; with prefix caching, later requests prefill only
    their own part, so their first tokens come sooner."""
    cost = AnalyticCostModel.preset("opt-13b", "a100-80gb")
    spec = WorkloadSpec(seed=0, streams=[StreamSpec(
        num_requests=200, lengths=LengthSpec(dataset="fixed", input_len=64, output_len=16),
        arrivals=ArrivalSpec(rate=20.0), shared_prefix_tokens=960)])
    wl = build_workload(spec)
    assert all(x.prompt_tokens == 64 + 961 for x in wl.requests)
    assert all(x.prompt.startswith(wl.requests[0].prompt[:960 * 6]) for x in wl.requests)
    ttft = {}
    for caching in (True, False):
        config = SchedulerConfig(num_blocks=cost.num_kv_blocks(), block_size=16,
                                 max_batch_size=64, max_batch_tokens=2048, max_model_len=2048,
                                 prefix_caching=caching)
        out = simulate(wl.requests, config, cost)
        assert all(x.ok and x.output_tokens == 16 for x in out.records)
        ttft[caching] = summarize(out.records).ttft.median
    assert ttft[True] < 0.7 * ttft[False]
