"""Command line: `python -m bench <command> --help`.

Commands:
  workload        build a workload (ShareGPT / fixed / rescaled, Poisson or
                  Gamma arrivals, online/offline mix); print its statistics
                  and the ShareGPT record counts; optionally save it as JSONL
  run             one live run against an OpenAI-compatible server
  sweep           live runs over a list of rates; max rate under an SLO
  simulate        one simulated run (scheduler/ policy on a virtual clock)
  simulate-sweep  simulated runs over rates or loads; max rate under an SLO
  capacity        saturated throughput of a simulated configuration
  plot            PNG plots from result JSON files (runs or sweeps)
  merge           one system's run / sweep files as one sweep (interleaved runs)
  compare         a metric of two results side by side (live vs simulated)
  profile         measure our engine's iteration cost; write a cost table
  profile-live    a cost table from the iterations a running server recorded
  trace-live      the plans a running server's engine recorded
  trace-summary   compare plan traces (live and simulated)
  overload        offer a multiple of the server's capacity (open loop): 429
                  share, admitted TTFT / TPOT, server RSS over the run
  disconnects     open many streams and drop them all; check that every KV
                  block and host-tier byte comes back
  soak            a long mixed run: RSS growth (MB/hour), errors by kind,
                  429s, leaked KV blocks and host bytes
  transparency    probes alone, then beside long streams that force
                  preemption: each probe's tokens must be the same
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.metrics import SLOSpec, summarize
from bench.results import RunMeta, RunResult, as_sweep, load_result
from bench.workload import Workload, WorkloadSpec
from bench.cli_output import _emit, _finish_sweep
from bench.cli_sim import cluster_once, several_replicas, sim_setup
from bench.cli_workload import _client_config, _PoolCache, _workload_spec
from bench.replay import add_replay_args, replayed
from bench.cli_profile import add_profile_parsers
from bench.cli_trace import add_trace_parsers, write_trace
from bench.disconnects import add_disconnects_parser
from bench.overload import add_overload_parser
from bench.soak import add_soak_parser
from bench.transparency import add_transparency_parser
from bench.cli_args import (
    _add_live_args,
    _add_output_args,
    _add_sim_args,
    _add_slo_args,
    _add_sweep_args,
    _add_workload_args,
)
from bench.oracle import register as _register_oracles

# The simulator may also run the clairvoyant orders (bench/oracle.py).
_register_oracles()

# ----------------------------------------------------------------- arguments


def _slo(a: argparse.Namespace) -> SLOSpec | None:
    slo = SLOSpec(ttft=a.slo_ttft, tpot=a.slo_tpot, e2e=a.slo_e2e, normalized_latency=a.slo_normalized)
    return None if slo.empty else slo


# ------------------------------------------------------------------ live


def _live_once(wl: Workload, a: argparse.Namespace, slo: SLOSpec | None, rate: float | None) -> RunResult:
    from bench.client import run_requests, scrape_prometheus, settings_sent

    cfg = _client_config(a)
    before = scrape_prometheus(a.metrics_url) if a.metrics_url else None
    live = run_requests(wl.requests, cfg)
    details: dict[str, Any] = {
        "base_url": cfg.base_url, "endpoint": cfg.endpoint, "model": live.model,
        "wall_time": live.wall_time, "source": wl.source,
        # What every request was sent beyond its workload (the max_tokens cap
        # that `simulate --lengths-from` replays answers under).
        "client": settings_sent(cfg),
    }
    if before is not None:
        after = scrape_prometheus(a.metrics_url)
        details["server_counters_delta"] = {
            k: after[k] - before.get(k, 0.0) for k in after
            if ("preempt" in k or "swap" in k) and after[k] != before.get(k, 0.0)
        }
    return RunResult(
        meta=RunMeta(mode="live", system=a.system or f"live:{live.model}", workload=wl.spec,
                     rate=rate, details=details),
        summary=summarize(live.records, slo),
        records=live.records,
    )


def cmd_run(a: argparse.Namespace) -> int:
    spec = _workload_spec(a)
    wl = _PoolCache(a.tokenizer, need_text=True).build(spec)
    res = _live_once(wl, a, _slo(a), spec.streams[0].arrivals.rate)
    _emit(res, a, f"live run, rate {spec.streams[0].arrivals.rate:g}/s")
    return 0


def cmd_sweep(a: argparse.Namespace) -> int:
    from bench.sweep import Criterion, run_sweep

    if not a.rates:
        raise SystemExit("--rates is required")
    spec = _workload_spec(a)
    pools = _PoolCache(a.tokenizer, need_text=True)
    slo = _slo(a)
    crit = Criterion.parse(a.criterion) if a.criterion else None

    def evaluate(rate: float) -> RunResult:
        res = _live_once(pools.build(spec.with_rate(rate)), a, slo, rate)
        s = res.summary
        print(f"rate {rate:g}: {s.num_completed}/{s.num_requests} done, mean NL "
              f"{s.normalized_latency.mean}", flush=True)
        return res

    sweep = run_sweep(a.rates, evaluate, system=a.system or "live", mode="live", criterion=crit)
    _finish_sweep(sweep, a, slo)
    return 0


# ------------------------------------------------------------- simulation


def _sim_once(
    wl: Workload, cost: Any, sc: Any, a: argparse.Namespace, slo: SLOSpec | None,
    rate: float | None, load: float | None, capacity: float | None,
) -> RunResult:
    from bench.simulator import SimOptions, simulate

    trace_out = getattr(a, "trace_out", None)
    system = a.system or f"{sc.policy}/{cost.name}"
    details = {"scheduler": sc.model_dump(), "cost_model": cost.describe(),
               "capacity": capacity, "source": wl.source}
    if several_replicas(a):
        if trace_out is not None:
            raise SystemExit("--trace-out records one replica's plans: not with --replicas "
                             "or --max-replicas")
        records, details["cluster"] = cluster_once(wl, cost, sc, a)
    else:
        out = simulate(wl.requests, sc, cost,
                       SimOptions(overlap_swap=a.overlap_swap, trace=trace_out is not None,
                                  prediction_delay_s=getattr(a, "prediction_delay", None),
                                  predictions_at_first_token=getattr(
                                      a, "prediction_at_first_token", False)))
        if trace_out is not None:
            write_trace(trace_out, [r.to_json() for r in out.trace], out.stats.as_dict())
        records, details["sim"] = out.records, out.stats.as_dict()
    return RunResult(
        meta=RunMeta(mode="sim", system=system, workload=wl.spec, rate=rate, load=load,
                     details=details),
        summary=summarize(records, slo),
        records=records,
    )


def _capacity(spec: WorkloadSpec, pools: _PoolCache, cost: Any, sc: Any, basis: str,
              a: argparse.Namespace | None = None) -> float:
    """Saturated throughput on the workload (and what `a` replays into it)."""
    from bench.simulator import measure_capacity

    wl = pools.build(spec.with_rate(math.inf))
    if a is not None:
        wl = replayed(wl, a)
    if basis == "mean-fixed":
        n = len(wl.requests)
        mean_in = round(sum(r.prompt_tokens for r in wl.requests) / n)
        mean_out = round(sum(r.output_tokens for r in wl.requests) / n)
        wl = Workload(spec=wl.spec, requests=[
            r.model_copy(update={"prompt_tokens": mean_in, "output_tokens": mean_out})
            for r in wl.requests
        ])
    return measure_capacity(wl.requests, sc, cost)


def cmd_simulate(a: argparse.Namespace) -> int:
    spec = _workload_spec(a)
    pools = _PoolCache(a.tokenizer, need_text=False)
    cost, sc = sim_setup(a)
    capacity = None
    rate = spec.streams[0].arrivals.rate
    if a.load is not None:
        capacity = _capacity(spec, pools, cost, sc, a.capacity_basis, a)
        rate = a.load * capacity
        spec = spec.with_rate(rate)
    wl = replayed(pools.build(spec), a)
    res = _sim_once(wl, cost, sc, a, _slo(a), rate, a.load, capacity)
    sim = res.meta.details.get("sim") or res.meta.details["cluster"]
    iterations = sim["iterations"]
    if isinstance(iterations, dict):  # per replica
        iterations = sum(iterations.values())
        print(f"{sim['replicas_started']} replicas started, "
              f"{sim['replica_seconds']:.1f} replica-seconds")
    print(f"simulated {res.summary.num_requests} requests, "
          f"{iterations} iterations in {sim['wall_time']:.2f} s wall"
          + (f"; capacity {capacity:.3f} req/s, rate {rate:.3f}" if capacity else ""))
    _emit(res, a, f"simulated {res.meta.system}, rate {rate:g}/s")
    return 0


def cmd_simulate_sweep(a: argparse.Namespace) -> int:
    from bench.sweep import Criterion, bisect_max_rate, max_rate_on_grid, run_sweep

    spec = _workload_spec(a)
    pools = _PoolCache(a.tokenizer, need_text=False)
    cost, sc = sim_setup(a)
    slo = _slo(a)
    crit = Criterion.parse(a.criterion) if a.criterion else None
    capacity = None
    if a.loads:
        capacity = _capacity(spec, pools, cost, sc, a.capacity_basis, a)
        print(f"capacity ({a.capacity_basis}): {capacity:.3f} req/s", flush=True)
        rates = [ld * capacity for ld in a.loads]
    elif a.rates:
        rates = list(a.rates)
    else:
        raise SystemExit("give --rates or --loads")

    def evaluate(rate: float) -> RunResult:
        load = rate / capacity if capacity else None
        res = _sim_once(replayed(pools.build(spec.with_rate(rate)), a), cost, sc, a, slo, rate,
                        load, capacity)
        s = res.summary
        ran = res.meta.details.get("sim") or res.meta.details["cluster"]
        print(f"rate {rate:.3f}: mean NL {s.normalized_latency.mean:.4f} s/token, "
              f"wall {ran['wall_time']:.1f} s", flush=True)
        return res

    system = a.system or f"{sc.policy}/{cost.name}"
    sweep = run_sweep(rates, evaluate, system=system, mode="sim", criterion=crit, capacity=capacity)
    if crit is not None and a.bisect:
        ordered = sorted(rates)
        best = max_rate_on_grid(sweep.points, crit)
        lo = best if best is not None else ordered[0] / 4
        above = [r for r in ordered if r > lo]
        hi = above[0] if above else lo * 2
        refined, _ = bisect_max_rate(evaluate, crit, lo, hi)
        sweep.max_rate = refined
    _finish_sweep(sweep, a, slo)
    return 0


def cmd_capacity(a: argparse.Namespace) -> int:
    spec = _workload_spec(a)
    pools = _PoolCache(a.tokenizer, need_text=False)
    if several_replicas(a):
        raise SystemExit("--replicas, --max-replicas: capacity is measured on one replica")
    cost, sc = sim_setup(a)
    cap = _capacity(spec, pools, cost, sc, a.capacity_basis)
    print(json.dumps({"capacity_req_per_s": cap, "basis": a.capacity_basis, "cost_model": cost.name,
                      "num_blocks": sc.num_blocks, "max_batch_size": sc.max_batch_size}, indent=1))
    return 0


# ----------------------------------------------------------------- other


def cmd_workload(a: argparse.Namespace) -> int:
    spec = _workload_spec(a)
    wl = _PoolCache(a.tokenizer, need_text=a.out is not None).build(spec)
    print(json.dumps({"source": wl.source, "stats": wl.stats()}, indent=1))
    if a.out is not None:
        wl.save_jsonl(a.out)
        print(f"wrote {a.out}")
    return 0


def cmd_plot(a: argparse.Namespace) -> int:
    from bench.plots import plot_all

    sweeps = [as_sweep(load_result(p)) for p in a.results]
    for path in plot_all(sweeps, a.out_dir, slo=a.slo, prefix=a.prefix):
        print(f"wrote {path}")
    return 0


def cmd_merge(a: argparse.Namespace) -> int:
    from bench.results import merge_sweeps, save_result

    merged = merge_sweeps([load_result(p) for p in a.results])
    save_result(merged, a.out)
    print(f"wrote {a.out} ({len(merged.points)} points of {merged.system})")
    return 0


def cmd_compare(a: argparse.Namespace) -> int:
    """Relative difference of one metric between two results, rate by rate
    (the live-vs-simulated validation: within 20% of mean normalized
    latency)."""
    from bench.sweep import Criterion

    metric = Criterion(metric=a.metric, op="<=", value=0.0)
    metric.lookup(None)  # validates the path
    ref, other = (as_sweep(load_result(p)) for p in (a.reference, a.other))
    by_rate = {round(p.meta.rate or 0.0, 6): p for p in other.points}
    worst = 0.0
    print(f"{'rate':>8} {ref.system[:18]:>18} {other.system[:18]:>18} {'rel diff':>9}")
    for p in sorted(ref.points, key=lambda p: p.meta.rate or 0.0):
        q = by_rate.get(round(p.meta.rate or 0.0, 6))
        if q is None:
            continue
        x, y = metric.lookup(p.summary), metric.lookup(q.summary)
        if x is None or y is None:
            continue
        rel = abs(y - x) / abs(x) if x else float("inf")
        worst = max(worst, rel)
        print(f"{p.meta.rate or 0:8.3f} {x:18.5f} {y:18.5f} {100 * rel:8.1f}%")
    ok = worst <= a.tolerance
    print(f"max relative difference {100 * worst:.1f}% "
          f"({'within' if ok else 'over'} {100 * a.tolerance:.0f}%)")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    q = sub.add_parser("workload", help="build a workload, print its statistics")
    _add_workload_args(q)
    q.add_argument("--out", type=Path, default=None, help="save as JSONL")
    q.set_defaults(func=cmd_workload)

    q = sub.add_parser("run", help="one live run against an OpenAI-compatible server")
    _add_workload_args(q)
    _add_live_args(q)
    _add_slo_args(q)
    _add_output_args(q)
    q.set_defaults(func=cmd_run)

    q = sub.add_parser("sweep", help="live runs over --rates")
    _add_workload_args(q)
    _add_live_args(q)
    _add_slo_args(q)
    _add_output_args(q)
    _add_sweep_args(q, loads=False)
    q.set_defaults(func=cmd_sweep)

    q = sub.add_parser("simulate", help="one simulated run")
    _add_workload_args(q)
    _add_sim_args(q)
    _add_slo_args(q)
    _add_output_args(q)
    q.add_argument("--load", type=float, default=None,
                   help="set the rate to this fraction of the measured capacity")
    q.add_argument("--trace-out", type=Path, default=None,
                   help="also save every plan (python -m bench trace-summary)")
    add_replay_args(q)
    q.set_defaults(func=cmd_simulate)

    q = sub.add_parser("simulate-sweep", help="simulated runs over --rates or --loads")
    _add_workload_args(q)
    _add_sim_args(q)
    _add_slo_args(q)
    _add_output_args(q)
    _add_sweep_args(q, loads=True)
    add_replay_args(q)
    q.set_defaults(func=cmd_simulate_sweep)

    q = sub.add_parser("capacity", help="saturated throughput of a simulated configuration")
    _add_workload_args(q)
    _add_sim_args(q)
    q.set_defaults(func=cmd_capacity)

    q = sub.add_parser("plot", help="PNG plots from result JSON files")
    q.add_argument("results", type=Path, nargs="+", help="run or sweep JSON files")
    q.add_argument("--out-dir", type=Path, default=Path("runs/plots"))
    q.add_argument("--slo", type=float, default=None, help="SLO line (s/token)")
    q.add_argument("--prefix", default="")
    q.set_defaults(func=cmd_plot)

    q = sub.add_parser("merge", help="one system's run / sweep JSON files as one sweep")
    q.add_argument("results", type=Path, nargs="+")
    q.add_argument("--out", type=Path, required=True)
    q.set_defaults(func=cmd_merge)

    q = sub.add_parser("compare", help="compare a metric of two results rate by rate")
    q.add_argument("reference", type=Path, help="e.g. the live run or sweep")
    q.add_argument("other", type=Path, help="e.g. the simulated run or sweep")
    q.add_argument("--metric", default="normalized_latency.mean")
    q.add_argument("--tolerance", type=float, default=0.2)
    q.set_defaults(func=cmd_compare)

    add_profile_parsers(sub)
    add_trace_parsers(sub)
    add_overload_parser(sub)
    add_disconnects_parser(sub)
    add_soak_parser(sub)
    add_transparency_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
