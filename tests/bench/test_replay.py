"""`bench simulate --lengths-from`: a run's answers replayed at the lengths
they came out, each ending where it ended live."""

from __future__ import annotations

import pytest

from bench.__main__ import main
from bench.replay import with_recorded_lengths
from bench.results import RunResult, SweepResult, load_result, save_result
from bench.workload import Workload, WorkloadSpec

from tests.bench.fake_openai import running

server = pytest.fixture(scope="module")(running)

COMMON = ["--dataset", "fixed", "--input-len", "32", "--output-len", "40", "-n", "8",
          "--rate", "20", "--seed", "3"]


def _run(tmp_path, cap: int | None = 30) -> tuple[RunResult, object]:
    """A simulated run edited as a live one of natural answers records it:
    the client's cap, answers ending below it, prompts counted with a chat
    template, one request failed."""
    path = tmp_path / "run.json"
    assert main(["simulate", *COMMON, "--cost-model", "opt-13b", "--save-records",
                 "--out", str(path)]) == 0
    run = load_result(path)
    assert isinstance(run, RunResult) and run.records
    if cap is not None:
        run.meta.details["client"] = {"max_tokens": cap, "ignore_eos": True, "extra_body": {}}
    for i, r in enumerate(run.records):
        r.prompt_tokens = 32 + 9
        r.output_tokens = 5 + 3 * i if i < 7 else 30
    run.records[2].error = "timeout"
    save_result(run, path)
    return run, path


def _workload(path) -> Workload:
    from bench.cli_workload import _PoolCache

    spec = load_result(path).meta.workload
    assert isinstance(spec, WorkloadSpec)
    return _PoolCache("embedded:smollm2", need_text=False).build(spec)


def test_answers_replay_at_their_own_lengths_under_the_cap(tmp_path):
    run, path = _run(tmp_path)
    wl = _workload(path)
    out = {r.request_id: r for r in with_recorded_lengths(wl, path).requests}
    for i, rec in enumerate(run.records):
        r = out[rec.request_id]
        if i == 2:  # not finished live: the workload's length, cut at the cap
            assert (r.prompt_tokens, r.output_tokens, r.max_tokens) == (32, 30, None)
            continue
        assert r.prompt_tokens == 41 and r.output_tokens == rec.output_tokens
        # Ended by itself below its cap: the cap is what the scheduler knows.
        assert r.max_tokens == (None if rec.output_tokens == 30 else 30)
    # The simulator serves them so: each answer as long as live, each job
    # ending by end-of-sequence below a cap it was sized for.
    sim_path = tmp_path / "sim.json"
    assert main(["simulate", "--workload-spec", str(path), "--lengths-from", str(path),
                 "--cost-model", "opt-13b", "--policy", "mlfq", "--save-records",
                 "--out", str(sim_path)]) == 0
    sim = load_result(sim_path)
    assert isinstance(sim, RunResult) and sim.records
    assert {r.request_id: r.output_tokens for r in sim.records} == {
        k: v.output_tokens for k, v in out.items()}
    assert {r.prompt_tokens for r in sim.records} == {41, 32}
    assert sim.meta.details["source"]["lengths_replayed"] == 7
    assert sim.meta.details["source"]["lengths_kept_from_workload"] == 1
    assert sim.meta.details["source"]["lengths_cap"] == 30


def test_a_run_without_its_cap_needs_one_given(tmp_path):
    _, path = _run(tmp_path, cap=None)
    wl = _workload(path)
    with pytest.raises(SystemExit, match="--lengths-cap"):
        with_recorded_lengths(wl, path)
    got = with_recorded_lengths(wl, path, cap=30)
    assert [r.max_tokens for r in got.requests].count(30) == 6
    with pytest.raises(SystemExit, match="more than the 20"):
        with_recorded_lengths(wl, path, cap=20)
    # An ignore_eos run's answers are the workload's lengths: no cap needed.
    path2 = tmp_path / "exact.json"
    assert main(["simulate", *COMMON, "--cost-model", "opt-13b", "--save-records",
                 "--out", str(path2)]) == 0
    exact = with_recorded_lengths(wl, path2)
    assert [(r.output_tokens, r.max_tokens) for r in exact.requests] == [(40, None)] * 8


def test_a_recorded_cap_is_not_overridden(tmp_path):
    _, path = _run(tmp_path)
    with pytest.raises(SystemExit, match="records that its requests were sent max_tokens 30"):
        with_recorded_lengths(_workload(path), path, cap=64)
    with pytest.raises(SystemExit, match="--lengths-cap: with --lengths-from"):
        main(["simulate", *COMMON, "--cost-model", "opt-13b", "--lengths-cap", "8"])


def test_a_live_run_records_its_cap_and_replays(server, tmp_path):
    live = tmp_path / "live.json"
    assert main(["run", *COMMON[:-4], "-n", "4", "--rate", "50", "--base-url",
                 server.base_url, "--endpoint", "chat", "--max-tokens", "7",
                 "--max-duration", "20", "--save-records", "--out", str(live)]) == 0
    run = load_result(live)
    assert isinstance(run, RunResult) and run.summary.num_completed == 4
    client = run.meta.details["client"]
    assert client["max_tokens"] == 7 and client["temperature"] == 0.0
    # Answers under a cap end by themselves: neither was sent.
    assert client["ignore_eos"] is False and client["send_min_tokens"] is False
    assert all("ignore_eos" not in b and "min_tokens" not in b for b in server.bodies[-4:])
    assert "api_key" not in client
    sim_path = tmp_path / "sim.json"
    assert main(["simulate", "--workload-spec", str(live), "--lengths-from", str(live),
                 "--cost-model", "opt-13b", "--save-records", "--out", str(sim_path)]) == 0
    sim = load_result(sim_path)
    assert isinstance(sim, RunResult) and sim.records
    assert sorted(r.output_tokens for r in sim.records) == [7] * 4
    assert {r.prompt_tokens for r in sim.records} == {r.prompt_tokens for r in run.records}


def test_head_estimates_land_with_the_first_token(tmp_path):
    """`--prediction-at-first-token`: a replayed estimate lands when its
    request's first token is sampled (the engine head's moment), not on
    arrival nor after the run's recorded delay."""
    path = tmp_path / "run.json"
    args = ["--dataset", "fixed", "--input-len", "64", "--output-len", "24", "-n", "12",
            "--rate", "inf", "--seed", "1", "--cost-model", "opt-13b", "--max-batch-size", "4"]
    assert main(["simulate", *args, "--save-records", "--out", str(path)]) == 0
    run = load_result(path)
    assert isinstance(run, RunResult) and run.records
    for i, r in enumerate(run.records):
        r.predicted_output_tokens = 10 + i
        r.prediction_delay_s = 0.0 if i % 2 else None
    save_result(run, path)
    sim_path = tmp_path / "sim.json"
    assert main(["simulate", *args, "--policy", "econoserve", "--predictions-from", str(path),
                 "--prediction-at-first-token", "--save-records", "--out", str(sim_path)]) == 0
    sim = load_result(sim_path)
    assert isinstance(sim, RunResult) and sim.records
    waited = 0
    for r in sim.records:
        ttft = r.token_times[0] - r.scheduled_time
        assert r.predicted_output_tokens == 10 + int(r.request_id.split("-")[1])
        assert r.prediction_delay_s == pytest.approx(ttft)
        waited += ttft > 0.1
    assert waited >= 6  # with four running at once, most waited for their first token
    with pytest.raises(SystemExit, match="--prediction-at-first-token"):
        main(["simulate", *args, "--prediction-at-first-token"])


def test_a_sweep_replays_the_lengths_at_every_rate(tmp_path):
    run, path = _run(tmp_path)
    out = tmp_path / "sweep.json"
    assert main(["simulate-sweep", "--workload-spec", str(path), "--lengths-from", str(path),
                 "--cost-model", "opt-13b", "--rates", "5", "40", "--out", str(out)]) == 0
    sweep = load_result(out)
    assert isinstance(sweep, SweepResult) and [p.meta.rate for p in sweep.points] == [5, 40]
    for point in sweep.points:
        assert point.meta.details["source"]["lengths_replayed"] == 7
        assert point.meta.details["source"]["lengths_cap"] == 30
        assert point.summary.num_completed == 8
