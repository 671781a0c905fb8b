"""FastServe paper-scale simulated experiments (studies/fastserve_sim/README.md).

    python -m studies.fastserve_sim.run exp1 --gpu a100-40gb   # max rate under the SLO
    python -m studies.fastserve_sim.run exp1 --model opt-66b --gpu a100-80gb   # tp 4 (opt-175b: tp 8 x pp 2)
    python -m studies.fastserve_sim.run exp2 --gpu a100-40gb   # Fig. 14, I/O ratio sweep
    python -m studies.fastserve_sim.run exp3 --gpu a100-40gb   # Fig. 15, swap modes
    python -m studies.fastserve_sim.run plots

Every point is exactly `python -m bench simulate <args>` (the args are
stored with each point as `cmd`): the same argument parser, workload
builder, scheduler config and simulator, run in one process so the
ShareGPT pool is loaded once.  Where a point only has to decide pass/fail
against the SLO (exp1 bisection), the run stops early once a lower bound of
its mean normalized latency exceeds the SLO (`SimOptions.
abort_mean_normalized_latency`); such points are stored with
`aborted: true` and that bound.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import time
from pathlib import Path
from typing import Any

from bench.__main__ import _PoolCache, _workload_spec, build_parser
from bench.cli_sim import sim_setup
from bench.metrics import summarize
from bench.simulator import CostEstimatorAdapter, SimOptions, SLOAbort, measure_capacity, simulate
from bench.costmodel import AnalyticCostModel

OUT = Path(__file__).resolve().parent
N = 1000
SEED = 0
HOST = "host_kv_blocks=100000"  # 1.3 TB of 13 MB blocks: never the limit

SYSTEMS: dict[str, list[str]] = {
    "fcfs-recompute": ["--policy", "fcfs", "--sched-opt", 'swap_mode="recompute"'],
    "fcfs-reactive": ["--policy", "fcfs", "--sched-opt", 'swap_mode="reactive"', "--sched-opt", HOST],
    "mlfq-proactive": ["--policy", "mlfq", "--sched-opt", 'swap_mode="proactive"', "--sched-opt", HOST,
                       "--overlap-swap"],
    "mlfq-reactive": ["--policy", "mlfq", "--sched-opt", 'swap_mode="reactive"', "--sched-opt", HOST],
    "mlfq-recompute": ["--policy", "mlfq", "--sched-opt", 'swap_mode="recompute"'],
    "mlfq-naive-proactive": ["--policy", "mlfq-naive", "--sched-opt", 'swap_mode="proactive"',
                             "--sched-opt", HOST, "--overlap-swap"],
    "fixed-priority-proactive": ["--policy", "fixed-priority", "--sched-opt", 'swap_mode="proactive"',
                                 "--sched-opt", HOST, "--overlap-swap"],
}

_pools = _PoolCache(build_parser().parse_args(["simulate"]).tokenizer, need_text=False)


def base(gpu: str, rate: float, extra: list[str] | None = None,
         model: str = "opt-13b") -> list[str]:
    return ["--dataset", "sharegpt", "-n", str(N), "--seed", str(SEED), "--rate", f"{rate:g}",
            "--cost-model", model, "--gpu", gpu, *(extra or [])]


def slo_of(gpu: str, model: str = "opt-13b") -> tuple[float, float]:
    """(decode iteration at batch 1, SLO = 10x it) -- FastServe §6.1.  A
    model split over GPUs runs in its preset TP x PP (Fig. 11)."""
    cost = AnalyticCostModel.preset(model, gpu)
    t = CostEstimatorAdapter(cost).decode_time(1)
    return t, 10 * t


def point(args: list[str], abort: float | None = None) -> dict[str, Any]:
    a = build_parser().parse_args(["simulate", *args])
    spec = _workload_spec(a)
    wl = _pools.build(spec)
    cost, sc = sim_setup(a)
    cmd = "python -m bench simulate " + shlex.join(args)
    t0 = time.perf_counter()
    try:
        out = simulate(wl.requests, sc, cost, SimOptions(overlap_swap=a.overlap_swap,
                                                          abort_mean_normalized_latency=abort))
    except SLOAbort as e:
        wall = time.perf_counter() - t0
        print(f"  rate {a.rate:g}: ABORT mean NL >= {e.bound:.4f} at t={e.at:.0f}s "
              f"({e.finished}/{e.total} done), wall {wall:.1f}s", flush=True)
        return {"cmd": cmd, "rate": a.rate, "aborted": True, "nl_mean_lower_bound": e.bound,
                "aborted_at": e.at, "finished": e.finished, "wall_s": wall}
    s = summarize(out.records)
    st = out.stats.as_dict()
    b = s.breakdown
    res = {
        "cmd": cmd, "rate": a.rate, "aborted": False,
        "num_blocks": sc.num_blocks, "max_batch_size": sc.max_batch_size,
        "completed": s.num_completed,
        "nl_mean": s.normalized_latency.mean, "nl_p50": s.normalized_latency.median,
        "nl_p95": s.normalized_latency.p95, "nl_p99": s.normalized_latency.p99,
        "ttft_mean": s.ttft.mean, "ttft_p99": s.ttft.p99, "e2e_mean": s.e2e.mean,
        "throughput": s.request_throughput,
        "queueing_share": b.queueing_share if b else None,
        "execution_share": b.execution_share if b else None,
        "swap_share": b.swap_share if b else None,
        "mean_swap_s": b.mean_swap if b else None,
        "preemptions": st["num_preemptions"], "swap_in_blocks": st["swap_in_blocks"],
        "swap_out_blocks": st["swap_out_blocks"], "swap_gb": st["swap_bytes"] / 1e9,
        "exposed_swap_s": st["exposed_swap_time"], "swap_in_lane_busy_s": st["swap_in_lane_busy"],
        "busy_s": st["busy_time"], "end_s": out.end_time, "iterations": st["iterations"],
        "mean_batch": st["mean_batch_size"], "wall_s": st["wall_time"],
    }
    print(f"  rate {a.rate:g}: NL mean {res['nl_mean']:.4f} p95 {res['nl_p95']:.4f} "
          f"queue {100 * (res['queueing_share'] or 0):.1f}% swap {100 * (res['swap_share'] or 0):.2f}% "
          f"swapGB {res['swap_gb']:.0f} wall {res['wall_s']:.1f}s", flush=True)
    return res


def save(name: str, data: dict[str, Any]) -> None:
    path = OUT / name
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")


# ------------------------------------------------------------------ exp 1


def max_rate(system: str, gpu: str, grid: list[float], slo: float, extra: list[str] | None = None,
             rel_tol: float = 0.02, model: str = "opt-13b") -> dict[str, Any]:
    """Highest rate with mean NL <= slo: walk the grid up to the first
    failure, then bisect between the last pass and it."""
    print(f"{system} / {model} on {gpu} (SLO {slo:.4f} s/token)", flush=True)
    args = SYSTEMS[system] + (extra or [])
    pts: list[dict[str, Any]] = []

    def ok(rate: float) -> bool:
        p = point(base(gpu, rate, args, model), abort=slo)
        pts.append(p)
        return (not p["aborted"]) and p["nl_mean"] <= slo

    lo = hi = None
    for r in grid:
        if ok(r):
            lo = r
        else:
            hi = r
            break
    if lo is None or hi is None:
        return {"system": system, "max_rate": lo, "bracket": [lo, hi], "points": pts}
    while hi - lo > rel_tol * lo:
        mid = round((lo + hi) / 2, 4)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    print(f"  => max rate {lo:g} (fails at {hi:g})", flush=True)
    return {"system": system, "extra_args": extra or [], "max_rate": lo, "bracket": [lo, hi],
            "points": sorted(pts, key=lambda p: p["rate"])}


def exp1(gpu: str, systems: list[str], grid: list[float], tag: str = "",
         extra: list[str] | None = None, model: str = "opt-13b") -> None:
    dec, slo = slo_of(gpu, model)
    cost = AnalyticCostModel.preset(model, gpu)
    res = {"experiment": "max arrival rate meeting mean normalized latency <= 10x decode iteration",
           "model": model, "tp": cost.tp, "pp": cost.pp, "kv_blocks": cost.num_kv_blocks(),
           "gpu": gpu, "n": N, "seed": SEED, "decode_iteration_b1_s": dec, "slo_s_per_token": slo,
           "grid": grid, "systems": {}}
    path = OUT / (f"exp1_{gpu}{tag}.json" if model == "opt-13b"
                  else f"exp1_{model}_{gpu}{tag}.json")
    if path.exists():
        res = json.loads(path.read_text())
    for s in systems:
        res["systems"][s + tag] = max_rate(s, gpu, grid, slo, extra, model=model)
        save(path.name, res)


# ------------------------------------------------------------------ exp 2

# A run whose mean NL provably exceeds max(this, 5x FCFS's at the same
# ratio) s/token is stopped and reported as a lower bound (only to bound the
# time of a collapse).
EXP2_ABORT = 2.0


def exp2(gpu: str, ratios: list[float], load: float, systems: list[str]) -> None:
    path = OUT / f"exp2_{gpu}.json"
    res = json.loads(path.read_text()) if path.exists() else {
        "experiment": "Fig. 14: input/output ratio sweep at a fixed load of FCFS saturation",
        "gpu": gpu, "n": N, "seed": SEED, "load": load, "ratios": {}}
    for ratio in ratios:
        key = f"{ratio:g}"
        ent = res["ratios"].setdefault(key, {"points": {}})
        if "fcfs_capacity" not in ent:
            args = base(gpu, 1.0, ["--io-ratio", f"{ratio:g}"] + SYSTEMS["fcfs-reactive"])
            a = build_parser().parse_args(["simulate", *args])
            spec = _workload_spec(a)
            wl = _pools.build(spec.with_rate(math.inf))
            cost, sc = sim_setup(a)
            ent["fcfs_capacity"] = measure_capacity(wl.requests, sc, cost)
            ent["capacity_cmd"] = "python -m bench capacity " + shlex.join(args)
        rate = round(load * ent["fcfs_capacity"], 3)
        ent["rate"] = rate
        print(f"ratio {ratio:g}: FCFS capacity {ent['fcfs_capacity']:.3f} req/s, rate {rate}", flush=True)
        for s in systems:
            if s in ent["points"]:
                continue
            print(f" {s}", flush=True)
            fc = ent["points"].get("fcfs-reactive", {}).get("nl_mean")
            abort = max(EXP2_ABORT, 5 * fc) if fc else EXP2_ABORT
            ent["points"][s] = point(base(gpu, rate, ["--io-ratio", f"{ratio:g}"] + SYSTEMS[s]),
                                     abort=abort)
            save(path.name, res)


# ------------------------------------------------------------------ exp 3


# As EXP2_ABORT: bounds the time of a collapse (far above every curve).
EXP3_ABORT = 1.0


def exp3(gpu: str, rates: list[float], systems: list[str], extra: list[str] | None = None,
         tag: str = "") -> None:
    path = OUT / f"exp3_{gpu}{tag}.json"
    res = json.loads(path.read_text()) if path.exists() else {
        "experiment": "Fig. 15: MLFQ with proactive / reactive / recompute KV management",
        "gpu": gpu, "n": N, "seed": SEED, "extra_args": extra or [], "systems": {}}
    for s in systems:
        pts = res["systems"].setdefault(s, {})
        print(s, flush=True)
        for r in rates:
            if f"{r:g}" in pts:
                continue
            pts[f"{r:g}"] = point(base(gpu, r, SYSTEMS[s] + (extra or [])), abort=EXP3_ABORT)
            save(path.name, res)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["exp1", "exp2", "exp3", "plots"])
    p.add_argument("--gpu", default="a100-40gb")
    p.add_argument("--model", default="opt-13b",
                   help="exp1: opt-66b and opt-175b run in their Fig. 11 TP x PP")
    p.add_argument("--systems", nargs="+", default=None)
    p.add_argument("--grid", type=float, nargs="+", default=None)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.25, 1, 4, 16, 64, 256])
    p.add_argument("--load", type=float, default=1.2)
    p.add_argument("--rates", type=float, nargs="+", default=[2, 3, 3.5, 4, 4.5])
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=None,
                   help="more `python -m bench simulate` args for every point (last)")
    p.add_argument("--tag", default="")
    a = p.parse_args()
    if a.what == "exp1":
        exp1(a.gpu, a.systems or ["fcfs-recompute", "fcfs-reactive", "mlfq-proactive"],
             a.grid or [3, 4, 5, 6, 7, 8, 10, 12], a.tag, a.extra, a.model)
    elif a.what == "exp2":
        exp2(a.gpu, a.ratios, a.load, a.systems or ["fcfs-reactive", "fixed-priority-proactive",
                                                  "mlfq-naive-proactive", "mlfq-proactive"])
    elif a.what == "exp3":
        exp3(a.gpu, a.rates, a.systems or ["mlfq-proactive", "mlfq-reactive", "mlfq-recompute"],
             a.extra, a.tag)
    else:
        from studies.fastserve_sim.plots import main as plots_main

        plots_main(OUT)


if __name__ == "__main__":
    main()
