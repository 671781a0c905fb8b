"""Engine autoscaling at paper scale in the cluster simulator (issue 19's
"in simulation at paper scale": online SLO attainment and replica-seconds
against fixed-size deployments).

    python -m studies.autoscale_sim.run          # a few minutes: results.json, timeline.png
    python -m studies.autoscale_sim.run plot     # timeline.png from results.json

Llama-2-7B in FP16, one A100-80GB per replica (the analytic cost model),
`policy: mlfq` (serve_config.yaml's), ShareGPT with `ignore_eos`.  The trace
is bursty at every scale: Gamma arrivals with CV 4, in three phases of
`PHASE_S` seconds each, a quiet one, a busy one at several replicas' worth,
and a quiet one again.  Systems (bench/cluster_sim.py; placement and the
autoscaling policy are the server's code, scheduler/placement.py and
scheduler/autoscale.py, with the shipped `autoscaling` defaults but the
bounds):

- `fixed-K`: K replicas throughout;
- `autoscaled`: from 1 replica, between 1 and `MAX_REPLICAS`, a new replica
  ready `startup_s` after it is asked for (30 s: a 7B model's weights from
  local disk and the start-up profile; 120 s as a slower case).

Objectives: TTFT within 2 s (`admission.ttft_slo_s`'s default) and TPOT
within 3x a lone decode iteration (ConServe's default, which the policy's
TPOT signal uses).  A request meets its SLO when it meets both.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.__main__ import _PoolCache, build_parser
from bench.cli_sim import sim_setup
from bench.arrivals import ArrivalSpec
from bench.cluster_sim import ClusterOptions, linear_cost, simulate_cluster
from bench.metrics import SLOSpec, meets_slo, tpot
from bench.workload import StreamSpec, WorkloadSpec
from scheduler.autoscale import AutoscaleSettings

OUT = Path(__file__).resolve().parent
PHASE_S = 300.0
# (name, req/s): one replica serves about 11.3 req/s of this workload
# saturated (`measure_capacity`, MLFQ), so the busy phase needs about three.
PHASES = [("quiet-1", 4.0), ("busy", 30.0), ("quiet-2", 4.0)]
MAX_REPLICAS = 4
SIM = ["simulate", "--cost-model", "llama-2-7b", "--gpu", "a100-80gb", "--policy", "mlfq",
       "--dataset", "sharegpt"]
TTFT_SLO_S = 2.0


def workload() -> Any:
    streams = [StreamSpec(name=name, num_requests=int(rate * PHASE_S),
                          arrivals=ArrivalSpec(process="gamma", rate=rate, cv=4.0,
                                               start=k * PHASE_S))
               for k, (name, rate) in enumerate(PHASES)]
    a = build_parser().parse_args(SIM)
    return _PoolCache(a.tokenizer, need_text=False).build(WorkloadSpec(seed=0, streams=streams))


def systems() -> dict[str, ClusterOptions]:
    # KV copies overlap compute, as on a GPU's side stream.
    out = {f"fixed-{k}": ClusterOptions(replicas=k, ttft_slo_s=TTFT_SLO_S, overlap_swap=True)
           for k in range(1, MAX_REPLICAS + 1)}
    for startup in (30.0, 120.0):
        out[f"autoscaled-{startup:g}s"] = ClusterOptions(
            replicas=1, startup_s=startup, ttft_slo_s=TTFT_SLO_S, overlap_swap=True,
            autoscaling=AutoscaleSettings(enabled=True, min_replicas=1,
                                          max_replicas=MAX_REPLICAS))
    return out


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summary(records: list[Any], slo: SLOSpec, start: float, end: float) -> dict[str, Any]:
    rs = [r for r in records if start <= r.scheduled_time < end]
    ttfts = [r.ttft for r in rs if r.ttft is not None]
    tpots = [t for r in rs if (t := tpot(r)) is not None]
    return {
        "requests": len(rs),
        "finished": sum(r.ok for r in rs),
        "slo_attainment": sum(meets_slo(r, slo) for r in rs) / max(1, len(rs)),
        "ttft_attainment": sum(r.ttft is not None and r.ttft <= slo.ttft for r in rs)
        / max(1, len(rs)),
        "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
        "tpot_p50_s": _pct(tpots, 50), "tpot_p99_s": _pct(tpots, 99),
    }


def binned_p99(records: list[Any], bin_s: float = 10.0) -> list[tuple[float, float]]:
    """(bin middle, P99 TTFT) of the requests arriving in each `bin_s`."""
    pts = [(r.scheduled_time, r.ttft) for r in records if r.ttft is not None]
    bins: dict[int, list[float]] = {}
    for t, y in pts:
        bins.setdefault(int(t // bin_s), []).append(y)
    return [((k + 0.5) * bin_s, round(float(np.percentile(v, 99)), 4))
            for k, v in sorted(bins.items())]


def run() -> dict[str, Any]:
    wl = workload()
    cost, sc = sim_setup(build_parser().parse_args(SIM))
    slo = SLOSpec(ttft=TTFT_SLO_S, tpot=3 * linear_cost(cost).decode_time(1))
    out: dict[str, Any] = {"phases": PHASES, "phase_s": PHASE_S, "slo": slo.model_dump(),
                           "cmd": "python -m studies.autoscale_sim.run", "systems": {}}
    for name, opts in systems().items():
        res = simulate_cluster(wl.requests, sc, cost, opts)
        row: dict[str, Any] = {
            "options": opts.model_dump(), "replica_seconds": res.replica_seconds,
            "end_s": res.end_time, "timeline": res.timeline, "stats": res.stats,
            "all": summary(res.records, slo, 0.0, float("inf")),
            "phases": {p: summary(res.records, slo, k * PHASE_S, (k + 1) * PHASE_S)
                       for k, (p, _) in enumerate(PHASES)},
            "p99_ttft_by_arrival": binned_p99(res.records),
        }
        out["systems"][name] = row
        a = row["all"]
        print(f"{name:18s} SLO {a['slo_attainment']:.3f} TTFT<=2s {a['ttft_attainment']:.3f} "
              f"TTFT P99 {a['ttft_p99_s']:.2f}s TPOT P99 {a['tpot_p99_s'] * 1e3:.1f}ms "
              f"replica-s {res.replica_seconds:.0f} ({res.stats['wall_time']:.0f} s)", flush=True)
    return out


def plot(res: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, row in res["systems"].items():
        if not name.startswith("autoscaled") and name not in ("fixed-1", f"fixed-{MAX_REPLICAS}"):
            continue
        tl = row["timeline"]
        ax1.step([p[0] for p in tl], [p[2] for p in tl], where="post", label=name)
        mids = [p[0] for p in row["p99_ttft_by_arrival"]]
        p99 = [p[1] for p in row["p99_ttft_by_arrival"]]
        ax2.plot(mids, p99, label=name)
    ax1.set_ylabel("replicas ready")
    ax2.set_ylabel("P99 TTFT (s) by arrival, 10 s bins")
    ax2.set_yscale("log")
    ax2.axhline(TTFT_SLO_S, color="k", ls=":", lw=1)
    ax2.set_xlabel("arrival time (s)")
    for k in range(1, len(res["phases"])):
        for ax in (ax1, ax2):
            ax.axvline(k * res["phase_s"], color="grey", lw=0.5)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "timeline.png", dpi=120)


def main() -> None:
    path = OUT / "results.json"
    if sys.argv[1:] == ["plot"]:
        plot(json.loads(path.read_text()))
        return
    res = run()
    path.write_text(json.dumps(res, indent=1))
    plot(res)


if __name__ == "__main__":
    main()
