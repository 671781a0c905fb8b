"""Co-serving on several replicas at paper scale: the offline pool against
placing offline requests at once (issue 17, item 5), in the cluster
simulator (bench/cluster_sim.py, bench/cluster_pool.py).

    python -m studies.conserve_sim.replicas         # ~13 min: replicas.json
    python -m studies.conserve_sim.replicas table   # the README's tables from replicas.json

Llama-2-7B FP16, one A100-80GB per replica (analytic cost model), `policy:
conserve` with its default objectives, ShareGPT, `ignore_eos`.  Online:
Gamma arrivals with CV 4.  Offline: a backlog present at t = 0.

- **fixed**: 4 replicas throughout, online at 24 req/s for 300 s;
- **autoscaled**: from 1 replica up to 4 (30 s start, the shipped
  `autoscaling` defaults but the bounds), online at 4 req/s for 120 s,
  then 30 req/s for 300 s: the replicas that start during the burst find
  the backlog already placed, or waiting in the pool.

Systems: `at-once` (`offline_pool.enabled: false`: an offline request is
placed when it arrives, as an online one, by load), `pool` (the default:
it waits in the Scheduler's pool until a replica has room; a replica busy
with online work gives back waiting offline requests, started ones too,
their KV through the host tier the replicas share), `pool-unstarted-moves`
(only unstarted ones are given back: no shared tier), `pool-no-move`
(`offline_pool.move_queued: false`).

Offline throughput: offline tokens generated while the online stream
lasts, over that span.  Makespan: when the last offline request ended.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.__main__ import _PoolCache, build_parser
from bench.cli_sim import sim_setup
from bench.arrivals import ArrivalSpec
from bench.cluster_sim import ClusterOptions, linear_cost, simulate_cluster
from bench.metrics import tpot
from bench.workload import StreamSpec, WorkloadSpec
from scheduler.autoscale import AutoscaleSettings
from scheduler.config import OfflinePoolConfig

OUT = Path(__file__).resolve().parent
SIM = ["simulate", "--cost-model", "llama-2-7b", "--gpu", "a100-80gb", "--policy", "conserve",
       "--dataset", "sharegpt"]
# (the pool's settings, whether the replicas share a host tier)
POOLS = {"at-once": (OfflinePoolConfig(enabled=False), True),
         "pool": (OfflinePoolConfig(), True),
         "pool-unstarted-moves": (OfflinePoolConfig(), False),
         "pool-no-move": (OfflinePoolConfig(move_queued=False), True)}
SETUPS: dict[str, dict[str, Any]] = {
    "fixed": {"phases": [(24.0, 300.0)], "offline": 12_000, "replicas": 4, "max": None},
    "autoscaled": {"phases": [(4.0, 120.0), (30.0, 300.0)], "offline": 12_000,
                   "replicas": 1, "max": 4},
}


def workload(setup: dict[str, Any]) -> Any:
    streams, start = [], 0.0
    for k, (rate, span) in enumerate(setup["phases"]):
        streams.append(StreamSpec(name=f"online-{k}", num_requests=int(rate * span),
                                  arrivals=ArrivalSpec(process="gamma", rate=rate, cv=4.0,
                                                       start=start)))
        start += span
    streams.append(StreamSpec(name="offline", job_class="offline",
                              num_requests=setup["offline"],
                              arrivals=ArrivalSpec(rate=math.inf)))
    a = build_parser().parse_args(SIM)
    return _PoolCache(a.tokenizer, need_text=False).build(WorkloadSpec(seed=0, streams=streams))


def summary(res: Any, tpot_slo: float) -> dict[str, Any]:
    on = [r for r in res.records if r.job_class == "online"]
    off = [r for r in res.records if r.job_class == "offline"]
    span = max(r.scheduled_time for r in on)
    ttfts = [r.ttft for r in on if r.ttft is not None]
    tpots = [t for r in on if (t := tpot(r)) is not None]
    during = sum(sum(1 for t in r.token_times if t <= span) for r in off)
    return {
        "online": len(on), "offline": len(off), "finished": sum(r.ok for r in res.records),
        "online_ttft_p50_s": float(np.percentile(ttfts, 50)),
        "online_ttft_p99_s": float(np.percentile(ttfts, 99)),
        "online_tpot_p50_s": float(np.percentile(tpots, 50)),
        "online_tpot_p99_s": float(np.percentile(tpots, 99)),
        "online_tpot_within_slo": sum(t <= tpot_slo for t in tpots) / max(1, len(tpots)),
        "offline_tokens_per_s_online_span": during / span,
        "offline_makespan_s": max(r.end_time for r in off if r.end_time is not None),
        "replica_seconds": res.replica_seconds,
        "moved": res.stats["offline_moved"],
        "moved_started": res.stats["offline_moved_started"],
        "decisions": res.stats["decisions"],
    }


def run() -> dict[str, Any]:
    a = build_parser().parse_args(SIM)
    cost, sc = sim_setup(a)
    tpot_slo = 3 * linear_cost(cost).decode_time(1)
    out: dict[str, Any] = {"cmd": "python -m studies.conserve_sim.replicas",
                           "setups": SETUPS, "tpot_slo_s": tpot_slo, "results": {}}
    for sname, setup in SETUPS.items():
        wl = workload(setup)
        scale = AutoscaleSettings() if setup["max"] is None else AutoscaleSettings(
            enabled=True, min_replicas=1, max_replicas=setup["max"])
        for pname, (pool, shared) in POOLS.items():
            opts = ClusterOptions(replicas=setup["replicas"], autoscaling=scale, startup_s=30.0,
                                  overlap_swap=True, offline_pool=pool,
                                  shared_host_tier=shared)
            res = simulate_cluster(wl.requests, sc, cost, opts)
            row = summary(res, tpot_slo)
            row["wall_s"] = res.stats["wall_time"]
            out["results"][f"{sname}/{pname}"] = row
            print(f"{sname}/{pname}: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in row.items()), flush=True)
    return out


def table(res: dict[str, Any]) -> None:
    print("| setup / system | online TTFT P50 / P99 (s) | online TPOT P50 / P99 (ms) | "
          "offline tok/s while online runs | offline makespan (s) | moved (started) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in res["results"].items():
        print(f"| {name} | {r['online_ttft_p50_s']:.3f} / {r['online_ttft_p99_s']:.3f} | "
              f"{r['online_tpot_p50_s'] * 1e3:.1f} / {r['online_tpot_p99_s'] * 1e3:.1f} | "
              f"{r['offline_tokens_per_s_online_span']:,.0f} | {r['offline_makespan_s']:.1f} | "
              f"{r['moved']} ({r.get('moved_started', 0)}) |")


def main() -> None:
    path = OUT / "replicas.json"
    if sys.argv[1:] == ["table"]:
        table(json.loads(path.read_text()))
        return
    res = run()
    path.write_text(json.dumps(res, indent=1))
    table(res)


if __name__ == "__main__":
    main()
