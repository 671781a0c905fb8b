"""The cluster simulator: several replicas on one virtual clock, placed and
autoscaled by the server's own code."""

from __future__ import annotations

import numpy as np
import pytest

from bench.cluster_sim import Cluster, ClusterOptions, linear_cost, simulate_cluster
from bench.costmodel import make_cost_model
from bench.simulator import simulate
from bench.workload import RequestSpec
from scheduler.autoscale import AutoscaleSettings
from scheduler.config import SchedulerConfig

COST = make_cost_model("llama-2-7b", "a100-80gb")


def config(policy: str = "mlfq") -> SchedulerConfig:
    return SchedulerConfig(policy=policy, num_blocks=COST.num_kv_blocks(), block_size=16,
                           max_batch_size=256, max_batch_tokens=2048, max_model_len=4096)


def poisson(prefix: str, rate: float, start: float, end: float, seed: int,
            prompt: int = 512, output: int = 256) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    t, out = start, []
    while True:
        t += rng.exponential(1.0 / rate)
        if t >= end:
            return out
        out.append(RequestSpec(request_id=f"{prefix}-{len(out)}", arrival_time=t,
                               prompt_tokens=int(rng.integers(prompt // 2, prompt)),
                               output_tokens=int(rng.integers(output // 2, output))))


@pytest.mark.parametrize("policy", ["fcfs", "mlfq"])
def test_one_replica_is_the_simulator(policy: str) -> None:
    reqs = poisson("r", 6.0, 0.0, 30.0, seed=1)
    one = simulate(reqs, config(policy), COST)
    cluster = simulate_cluster(reqs, config(policy), COST, ClusterOptions(replicas=1))
    assert [r.token_times for r in cluster.records] == [r.token_times for r in one.records]
    assert cluster.end_time == one.end_time
    assert cluster.replica_seconds == pytest.approx(one.end_time)


def test_two_replicas_share_the_load_and_halve_the_queueing() -> None:
    reqs = poisson("r", 25.0, 0.0, 30.0, seed=2)
    one = simulate_cluster(reqs, config(), COST, ClusterOptions(replicas=1))
    c = Cluster(reqs, config(), COST, ClusterOptions(replicas=2))
    two = c.run()
    assert all(r.ok for r in two.records)
    placed = [sum(1 for rep in c.where.values() if rep is x) for x in c.replicas]
    assert min(placed) > 0.4 * len(reqs)  # by load, not all on one
    ttft = lambda out: np.mean([r.ttft for r in out.records])  # noqa: E731
    assert ttft(two) < 0.5 * ttft(one)
    assert two.replica_seconds == pytest.approx(2 * two.end_time)


def test_a_burst_scales_up_after_the_delay_and_back_down_when_quiet() -> None:
    burst = poisson("busy", 20.0, 10.0, 55.0, seed=3)
    quiet = poisson("quiet", 0.5, 0.0, 160.0, seed=4)
    reqs = burst + quiet
    scale = AutoscaleSettings(enabled=True, min_replicas=1, max_replicas=3,
                              upscale_delay_s=5.0, downscale_delay_s=30.0)
    opts = ClusterOptions(replicas=1, startup_s=10.0, autoscaling=scale)
    c = Cluster(reqs, config(), COST, opts)
    out = c.run()
    # Nothing is lost, on the replicas that drained either.
    assert all(r.ok for r in out.records)
    ups = [(t, n) for t, n in out.stats["decisions"] if n > 1]
    assert ups and ups[0][0] >= 10.0 + scale.upscale_delay_s
    assert max(n for _, n in out.stats["decisions"]) == 3
    # A new replica takes jobs only once it has started and reported.
    for rid, rep in c.where.items():
        assert c.jobs[rid].arrival_time >= rep.ready_at
    assert {rep.name for rep in c.where.values()} == {r.name for r in c.replicas}
    # Back to one once the burst's work is done and the quiet stream stays.
    assert out.timeline[-1][2] == 1 and out.stats["decisions"][-1][1] == 1
    fixed = simulate_cluster(reqs, config(), COST, ClusterOptions(replicas=3))
    alone = simulate_cluster(reqs, config(), COST, ClusterOptions(replicas=1))
    assert out.replica_seconds < 0.8 * fixed.replica_seconds
    p99 = lambda o: np.percentile([r.ttft for r in o.records], 99)  # noqa: E731
    assert p99(out) < 0.5 * p99(alone)


def test_the_replicas_cost_line_is_the_profilers_fit_of_the_model() -> None:
    line = linear_cost(COST)
    # A lone decode and a 256-token prompt as the cost model has them.
    from bench.simulator import CostEstimatorAdapter

    est = CostEstimatorAdapter(COST)
    assert line.decode_time(1) == pytest.approx(est.decode_time(1))
    assert line.prefill_time(256) == pytest.approx(est.prefill_time(256))
    assert line.decode_time(8) == pytest.approx(est.decode_time(8))


def test_cli_simulates_replicas_and_autoscaling(tmp_path) -> None:
    from bench.__main__ import main
    from bench.results import load_result

    common = ["simulate", "--dataset", "fixed", "--input-len", "512", "--output-len", "128",
              "-n", "600", "--rate", "30", "--cost-model", "llama-2-7b", "--policy", "mlfq"]
    runs = {}
    for name, extra in {"one": [], "two": ["--replicas", "2"],
                        "auto": ["--max-replicas", "3", "--startup-s", "5",
                                 "--autoscale-opt", "upscale_delay_s=2"]}.items():
        path = tmp_path / f"{name}.json"
        assert main([*common, *extra, "--out", str(path)]) == 0
        runs[name] = load_result(path)
    assert "cluster" not in runs["one"].meta.details
    two, auto = runs["two"].meta.details["cluster"], runs["auto"].meta.details["cluster"]
    assert two["replicas_started"] == 2 and two["decisions"] == []
    assert auto["options"]["autoscaling"]["upscale_delay_s"] == 2
    assert auto["replicas_started"] > 1 and auto["decisions"][0][0] >= 2
    ttft = {k: r.summary.ttft.mean for k, r in runs.items()}
    assert ttft["two"] < ttft["one"] and ttft["auto"] < ttft["one"]
    with pytest.raises(SystemExit, match="--trace-out"):
        main([*common, "--replicas", "2", "--trace-out", str(tmp_path / "t.json")])
    conserve = ["simulate", "--dataset", "fixed", "--input-len", "256", "--output-len", "64",
                "-n", "100", "--rate", "10", "--cost-model", "llama-2-7b", "--policy",
                "conserve", "--offline-num-requests", "200", "--offline-dataset", "fixed",
                "--replicas", "2"]
    for extra, pooled in (([], True), (["--offline-pool-opt", "enabled=false"], False)):
        path = tmp_path / f"conserve-{pooled}.json"
        assert main([*conserve, *extra, "--out", str(path)]) == 0
        res = load_result(path)
        assert res.meta.details["cluster"]["options"]["offline_pool"]["enabled"] is pooled
        assert res.summary.num_requests == res.summary.num_completed == 300


def test_offline_work_waits_in_the_pool_for_a_replica_that_starts_later() -> None:
    """Co-serving on two replicas, the second started by the autoscaler:
    offline requests placed at once all land on the first; from the pool
    (bench/cluster_pool.py over scheduler/offline_pool.py), the second takes
    its share when it comes, and online requests queue less."""
    from scheduler.config import OfflinePoolConfig

    online = poisson("on", 16.0, 0.0, 40.0, seed=1)
    offline = [r.model_copy(update={"job_class": "offline", "arrival_time": 0.0})
               for r in poisson("off", 100.0, 0.0, 5.0, seed=2)]
    scale = AutoscaleSettings(enabled=True, min_replicas=1, max_replicas=2,
                              upscale_delay_s=2.0, downscale_delay_s=600.0)
    shares, p99 = {}, {}
    for name, pool in {"at once": OfflinePoolConfig(enabled=False),
                       "pool": OfflinePoolConfig()}.items():
        c = Cluster(online + offline, config("conserve"), COST, ClusterOptions(
            replicas=1, startup_s=10.0, autoscaling=scale, offline_pool=pool))
        out = c.run()
        assert all(r.ok for r in out.records) and len(c.replicas) == 2
        shares[name] = sum(1 for r in offline if c.where[r.request_id] is c.replicas[1])
        p99[name] = np.percentile([r.ttft for r in out.records if r.job_class == "online"], 99)
    assert shares["at once"] == 0 and shares["pool"] > 0.3 * len(offline)
    assert p99["pool"] < p99["at once"]


def test_started_offline_work_leaves_a_replica_busy_with_online_work() -> None:
    """Two replicas, three offline requests each (2 running, 1 queued),
    then one long online request, beside which no offline token may run.
    Once the other replica runs out of offline work, the busy one gives
    back its queued request and, when the replicas share a host tier, its
    started ones too, which go on there from their tokens and host blocks:
    the offline work ends long before the online request instead of after
    it, and the online request ends when it would have."""
    from bench.workload import RequestSpec
    from scheduler.config import OfflinePoolConfig

    cfg = config("conserve").model_copy(update={"conserve": config().conserve.model_copy(
        update={"offline_max_batch_size": 2, "ttft_slo_s": 1e-6, "tpot_slo_s": 1e-6})})
    reqs = [RequestSpec(request_id=f"off-{i}", job_class="offline", arrival_time=0.0,
                        prompt_tokens=200, output_tokens=400) for i in range(6)]
    reqs.append(RequestSpec(request_id="on", arrival_time=1.0, prompt_tokens=100,
                            output_tokens=3000))
    pool = OfflinePoolConfig(replica_queue_jobs=1, queue_per_start=0)
    out = {}
    for shared in (False, True):
        out[shared] = simulate_cluster(reqs, cfg, COST, ClusterOptions(
            replicas=2, offline_pool=pool, shared_host_tier=shared))
    ends = {}
    for shared, res in out.items():
        assert all(r.ok for r in res.records)
        for r in res.records:  # every token once, in order, across the move
            assert len(r.token_times) == r.output_tokens == r.expected_output_tokens
            assert r.token_times == sorted(r.token_times)
        ends[shared] = {r.job_class: max(x.end_time for x in res.records
                                         if x.job_class == r.job_class) for r in res.records}
    assert out[False].stats["offline_moved_started"] == 0
    assert out[True].stats["offline_moved_started"] >= 1
    assert ends[True]["online"] == pytest.approx(ends[False]["online"])
    assert ends[False]["offline"] > ends[False]["online"] > 2 * ends[True]["offline"]


def test_cli_refuses_what_the_replica_count_would_ignore(tmp_path) -> None:
    from bench.__main__ import main
    from bench.results import SweepResult, load_result

    common = ["--dataset", "fixed", "--input-len", "256", "--output-len", "32", "-n", "40",
              "--cost-model", "llama-2-7b", "--policy", "mlfq"]
    for args, named in (
            (["simulate", *common, "--load", "0.5", "--replicas", "2"], "--load"),
            (["simulate-sweep", *common, "--loads", "0.5", "--max-replicas", "2"], "--loads"),
            (["capacity", *common, "--replicas", "2"], "--replicas"),
            (["simulate", *common, "--rate", "4", "--startup-s", "5"], "--startup-s"),
            (["simulate", *common, "--rate", "4", "--replicas", "2",
              "--autoscale-opt", "upscale_delay_s=2"], "--autoscale-opt")):
        with pytest.raises(SystemExit, match=named):
            main(args)
    # A sweep over several replicas runs (it read one replica's figures).
    out = tmp_path / "sweep.json"
    assert main(["simulate-sweep", *common, "--rates", "4", "8", "--replicas", "2",
                 "--out", str(out)]) == 0
    sweep = load_result(out)
    assert isinstance(sweep, SweepResult) and [p.meta.rate for p in sweep.points] == [4, 8]
    assert all(p.meta.details["cluster"]["replicas_started"] == 2 for p in sweep.points)


def test_cli_overrides_reach_every_analytic_preset(tmp_path) -> None:
    from bench.__main__ import main
    from bench.results import load_result

    common = ["simulate", "--dataset", "fixed", "--input-len", "256", "--output-len", "32",
              "-n", "40", "--rate", "4", "--policy", "fcfs"]
    blocks = {}
    for name, extra in {"default": [], "tp2": ["--tp", "2"],
                        "big_blocks": ["--block-size", "32"]}.items():
        path = tmp_path / f"{name}.json"
        assert main([*common, "--cost-model", "llama-2-7b", *extra, "--out", str(path)]) == 0
        details = load_result(path).meta.details
        blocks[name] = details["scheduler"]["num_blocks"]
        if name == "tp2":
            assert details["cost_model"]["tp"] == 2
    # Twice the GPUs hold more blocks; blocks twice as large, half as many.
    assert blocks["tp2"] > blocks["default"]
    assert blocks["big_blocks"] == pytest.approx(blocks["default"] / 2, abs=1)
