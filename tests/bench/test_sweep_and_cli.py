"""Sweeps, max rate under an SLO, result JSON, plots and the command line."""

from __future__ import annotations

import json

import pytest

from bench.__main__ import main
from bench.cli_trace import read_trace
from bench.metrics import summarize
from bench.records import RequestRecord
from bench.results import (
    RunMeta, RunResult, SweepResult, as_sweep, load_result, merge_sweeps, save_result,
)
from bench.sweep import (Criterion, bisect_max_rate, completed_share, is_stable,
                         max_rate_on_grid, run_sweep)
from bench.workload import WorkloadSpec


def fake_run(rate: float, completed_share: float = 1.0) -> RunResult:
    """Normalized latency 0.1 s/token below rate 4, then growing fast; 1000
    requests sent at `rate`, completed at `completed_share` of it."""
    nl = 0.1 if rate < 4 else 0.1 + (rate - 4) * 0.5
    recs = [RequestRecord(request_id=f"r{i}", scheduled_time=i / rate, send_time=i / rate,
                          token_times=[i / rate + nl], end_time=i / rate + 10 * nl,
                          output_tokens=10, queueing_time=nl, execution_time=9 * nl)
            for i in range(1000)]
    summary = summarize(recs)
    if completed_share < 1.0:
        summary = summary.model_copy(update={"request_throughput": completed_share * rate})
    return RunResult(meta=RunMeta(mode="sim", system="fake", workload=WorkloadSpec(), rate=rate),
                     summary=summary, records=recs)


def test_criterion():
    c = Criterion.parse("normalized_latency.mean<=0.3")
    assert str(c) == "normalized_latency.mean<=0.3"
    assert c.holds(fake_run(1).summary) and not c.holds(fake_run(5).summary)
    assert Criterion.parse("slo_attainment>=0.95").lookup(fake_run(1).summary) is None
    for bad in ("nope.mean<=1", "normalized_latency.mean<1", "ttft.p42<=1"):
        with pytest.raises(ValueError):
            Criterion.parse(bad)


def test_grid_and_bisection():
    c = Criterion.parse("normalized_latency.mean<=0.3")
    sweep = run_sweep([1, 2, 3, 4, 5, 6], fake_run, system="fake", mode="sim", criterion=c)
    assert [p.meta.rate for p in sweep.points] == [1, 2, 3, 4, 5, 6]
    assert all(p.records is None for p in sweep.points)
    # 0.1 + (r - 4) * 0.5 <= 0.3  <=>  r <= 4.4: the grid says 4.
    assert sweep.max_rate == 4
    rate, runs = bisect_max_rate(fake_run, c, 4, 5, rel_tol=0.001, iterations=20)
    assert rate == pytest.approx(4.4, abs=0.01)
    assert runs
    assert max_rate_on_grid(sweep.points, Criterion.parse("normalized_latency.mean<=0.01")) is None
    assert sweep.unstable_rates == [6]  # a long tail stretches the run


def test_an_unstable_run_never_gives_the_max_rate():
    c = Criterion.parse("normalized_latency.mean<=0.3")
    # Rate 3 keeps its latency but completes 80 % of what was offered.
    sweep = run_sweep([1, 2, 3, 4], lambda r: fake_run(r, 0.8 if r == 3 else 1.0),
                      system="fake", mode="sim", criterion=c)
    assert sweep.max_rate == 2 and sweep.unstable_rates == [3]
    assert completed_share(sweep.points[2]) == pytest.approx(0.8)
    assert is_stable(sweep.points[3])
    rate, _ = bisect_max_rate(lambda r: fake_run(r, 0.8 if r > 3 else 1.0), c, 2, 5,
                              rel_tol=0.001, iterations=20)
    assert rate == pytest.approx(3.0, abs=0.01)


def test_result_json_round_trip(tmp_path):
    run = fake_run(2)
    save_result(run, tmp_path / "run.json")
    back = load_result(tmp_path / "run.json")
    assert isinstance(back, RunResult) and back.summary == run.summary
    assert len(back.records) == 1000
    sweep = run_sweep([1, 5], fake_run, system="fake", mode="sim")
    save_result(sweep, tmp_path / "sweep.json")
    back2 = load_result(tmp_path / "sweep.json")
    assert isinstance(back2, SweepResult) and back2.points[1].meta.rate == 5
    assert as_sweep(back).points[0].meta.rate == 2


def test_merge_orders_points_by_rate_and_refuses_mixed_systems():
    runs = [fake_run(3), run_sweep([1, 5], fake_run, system="fake", mode="sim"), fake_run(2)]
    merged = merge_sweeps(runs)
    assert merged.system == "fake" and [p.meta.rate for p in merged.points] == [1, 2, 3, 5]
    with pytest.raises(ValueError, match="different systems"):
        merge_sweeps([fake_run(1), run_sweep([2], fake_run, system="other", mode="sim")])


def test_plots(tmp_path):
    from bench.plots import plot_all

    a = run_sweep([1, 2, 3, 5], fake_run, system="A", mode="sim")
    b = run_sweep([1, 2, 3], fake_run, system="B", mode="live")
    made = plot_all([a, b], tmp_path, slo=0.3)
    names = {p.name for p in made}
    assert {"latency_vs_rate.png", "p95_latency_vs_rate.png", "latency_breakdown.png"} <= names
    for p in made:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_simulate_sweep_and_plot(tmp_path, capsys):
    common = ["--dataset", "fixed", "--input-len", "64", "--output-len", "16", "-n", "40",
              "--cost-model", "opt-13b", "--max-batch-size", "8"]
    out = tmp_path / "sweep.json"
    assert main(["simulate-sweep", *common, "--loads", "0.5", "1.5",
                 "--criterion", "normalized_latency.mean<=0.05", "--out", str(out),
                 "--plot-dir", str(tmp_path / "plots")]) == 0
    sweep = load_result(out)
    assert isinstance(sweep, SweepResult) and sweep.capacity and len(sweep.points) == 2
    assert [round(p.meta.load, 2) for p in sweep.points] == [0.5, 1.5]
    # Overload shows up as queueing.
    q = [p.summary.breakdown.queueing_share for p in sweep.points]
    assert q[1] > q[0]
    assert (tmp_path / "plots" / "latency_vs_rate.png").is_file()
    run = tmp_path / "run.json"
    assert main(["simulate", *common, "--rate", "5", "--slo-ttft", "1", "--out", str(run),
                 "--save-records"]) == 0
    res = load_result(run)
    assert isinstance(res, RunResult) and len(res.records) == 40
    assert res.summary.slo_attainment is not None
    assert main(["plot", str(out), str(run), "--out-dir", str(tmp_path / "p2"), "--slo", "0.05"]) == 0
    assert (tmp_path / "p2" / "latency_breakdown.png").is_file()
    capsys.readouterr()
    assert main(["workload", "--dataset", "fixed", "-n", "5", "--rate", "2",
                 "--offline-num-requests", "3", "--offline-dataset", "fixed"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["num_requests"] == 8 and stats["num_offline"] == 3


def test_cli_help():
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0


def test_cli_compare_and_replay(tmp_path, capsys):
    a = run_sweep([1, 2, 5], fake_run, system="live", mode="live")
    save_result(a, tmp_path / "a.json")
    b = a.model_copy(deep=True)
    b.points[2].summary.normalized_latency.mean *= 1.1
    save_result(b, tmp_path / "b.json")
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert "10.0%" in capsys.readouterr().out
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                 "--tolerance", "0.05"]) == 1
    # A recorded run's workload replays in the simulator.
    run = fake_run(3)
    run.meta.workload = WorkloadSpec.model_validate({"seed": 4, "streams": [{
        "num_requests": 6, "lengths": {"dataset": "fixed", "input_len": 8, "output_len": 4},
        "arrivals": {"rate": 3.0}}]})
    save_result(run, tmp_path / "live.json")
    out = tmp_path / "sim.json"
    assert main(["simulate", "--workload-spec", str(tmp_path / "live.json"), "--cost-model",
                 "opt-13b", "--out", str(out)]) == 0
    sim = load_result(out)
    assert sim.meta.rate == 3.0 and sim.summary.num_completed == 6
    assert sim.meta.workload == run.meta.workload


def test_cli_replays_recorded_predictions(tmp_path):
    common = ["simulate", "--dataset", "fixed", "--input-len", "32", "--output-len", "40",
              "-n", "8", "--rate", "20", "--seed", "3", "--cost-model", "opt-13b"]
    assert main([*common, "--save-records", "--out", str(tmp_path / "live.json")]) == 0
    live = load_result(tmp_path / "live.json")
    assert all(r.predicted_output_tokens is None for r in live.records)
    # As a live run against a server with a predictor records them (one
    # request without: its prediction did not land).
    preds = {r.request_id: 10 + i for i, r in enumerate(live.records)}
    preds[live.records[0].request_id] = None
    for r in live.records:
        r.predicted_output_tokens = preds[r.request_id]
    # And one that landed late: the replay gives it as late.
    late = live.records[1]
    late.prediction_delay_s = 0.3
    save_result(live, tmp_path / "live.json")
    assert main([*common, "--policy", "econoserve", "--save-records", "--predictions-from",
                 str(tmp_path / "live.json"), "--out", str(tmp_path / "sim.json")]) == 0
    sim = load_result(tmp_path / "sim.json")
    assert {r.request_id: r.predicted_output_tokens for r in sim.records} == preds
    delays = {r.request_id: r.prediction_delay_s for r in sim.records}
    assert delays.pop(late.request_id) >= 0.3
    assert set(delays.values()) == {None}
    assert sim.summary.num_completed == 8
    # A run of other requests cannot lend them.
    other = ["simulate", "--dataset", "fixed", "--input-len", "32", "--output-len", "40",
             "-n", "3", "--rate", "20", "--seed", "3", "--cost-model", "opt-13b"]
    assert main([*other, "--save-records", "--out", str(tmp_path / "few.json")]) == 0
    few = load_result(tmp_path / "few.json")
    for r in few.records:
        r.request_id = "elsewhere-" + r.request_id
    save_result(few, tmp_path / "few.json")
    with pytest.raises(SystemExit, match="none of its requests"):
        main([*common, "--predictions-from", str(tmp_path / "few.json")])
    with pytest.raises(SystemExit, match="not a run with its records"):
        main([*common, "--predictions-from", str(_without_records(tmp_path))])


def _without_records(tmp_path):
    path = tmp_path / "norec.json"
    assert main(["simulate", "--dataset", "fixed", "--input-len", "8", "--output-len", "4",
                 "-n", "2", "--rate", "5", "--cost-model", "opt-13b", "--out", str(path)]) == 0
    return path


def test_cli_trace_out_and_summary(tmp_path, capsys):
    common = ["simulate", "--dataset", "fixed", "--input-len", "64", "--output-len", "16",
              "-n", "20", "--rate", "50", "--cost-model", "opt-13b", "--max-batch-size", "4"]
    for name in ("a.json.gz", "b.json"):
        assert main([*common, "--out", str(tmp_path / "run.json"),
                     "--trace-out", str(tmp_path / name)]) == 0
    sim = load_result(tmp_path / "run.json")
    trace = read_trace(tmp_path / "a.json.gz")
    assert trace == read_trace(tmp_path / "b.json")
    assert sum(len(r.jobs) for r in trace) == 20 * 16  # one prefill + 15 decodes each
    assert len(trace) == sim.meta.details["sim"]["iterations"]
    capsys.readouterr()
    assert main(["trace-summary", str(tmp_path / "a.json.gz"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["a", "b"]
    plans = next(line for line in out.splitlines() if line.startswith("plans"))
    assert plans.split()[1:] == [str(len(trace))] * 2
    with pytest.raises(SystemExit):
        read_trace(tmp_path / "run.json")


def test_a_live_trace_keeps_the_arrivals_beside_the_plans(tmp_path):
    import gzip
    import json

    from bench.cli_trace import write_trace
    from deployments.loop_stats import LoopStats
    from scheduler.plan import JobOutput, Plan, ScheduledChunk, StepResult
    from scheduler.trace import StepTrace

    stats = LoopStats()
    stats.arrival_times.append((5.0, "r1"))
    plan = Plan(1, [ScheduledChunk("r1", [1, 2, 3], 0, [0], True, 0)])
    stats.add_plan(StepTrace.of(5.5, plan, StepResult(1, [JobOutput("r1", 7)], 0.1)))
    live = stats.trace()
    assert live["arrivals"] == [[5.0, "r1"]]
    write_trace(tmp_path / "live.json.gz", live["plans"], {}, live["arrivals"])
    doc = json.loads(gzip.decompress((tmp_path / "live.json.gz").read_bytes()))
    assert doc["arrivals"] == [[5.0, "r1"]]
    assert [r.jobs for r in read_trace(tmp_path / "live.json.gz")] == [("r1",)]
