"""The simulator's command-line setup (`python -m bench simulate`,
`simulate-sweep`, `capacity`): the cost model and scheduler config the
options describe, the cluster options for several replicas, and the
refusal of options that one replica, or several, would ignore.  The
studies build their runs with `sim_setup` too."""

from __future__ import annotations

import argparse
import json
from typing import Any

from bench.workload import Workload


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def several_replicas(a: argparse.Namespace) -> bool:
    return a.replicas > 1 or a.max_replicas is not None


def check_replica_args(a: argparse.Namespace) -> None:
    """Options that apply only to one replica, or only to several, refused
    where they would be ignored."""
    if a.autoscale_opt and a.max_replicas is None:
        raise SystemExit("--autoscale-opt: autoscaling's, with --max-replicas")
    if several_replicas(a):
        one = [flag for flag, on in (
            ("--load", getattr(a, "load", None) is not None),
            ("--loads", bool(getattr(a, "loads", None))),
            ("--predictions-from", getattr(a, "predictions_from", None) is not None),
            ("--prediction-delay", getattr(a, "prediction_delay", None) is not None),
            ("--prediction-at-first-token", getattr(a, "prediction_at_first_token", False)))
            if on]
        if one:
            raise SystemExit(f"{', '.join(one)}: one replica's (capacity is measured on one, "
                             "predictions replayed on one); not with --replicas > 1 or "
                             "--max-replicas")
        return
    several = [flag for flag, on in (
        ("--offline-pool-opt", bool(a.offline_pool_opt)),
        ("--startup-s", a.startup_s is not None),
        ("--ttft-slo-s", a.ttft_slo_s is not None)) if on]
    if several:
        raise SystemExit(f"{', '.join(several)}: for several replicas (--replicas > 1 or "
                         "--max-replicas)")


def sim_setup(a: argparse.Namespace) -> tuple[Any, Any]:
    from bench.costmodel import MODELS, AnalyticCostModel, make_cost_model
    from scheduler.config import SchedulerConfig

    check_replica_args(a)
    over: dict[str, Any] = {}
    shape = ("tp", "pp", "compute_efficiency", "memory_efficiency")
    if a.cost_model in MODELS:  # an analytic preset: every figure may be overridden
        for k in (*shape, "iteration_overhead"):
            if getattr(a, k) is not None:
                over[k] = getattr(a, k)
        over["block_size"] = a.block_size
    else:  # a measured table: its figures are what was measured
        given = [f"--{k.replace('_', '-')}" for k in shape if getattr(a, k) is not None]
        if given:
            raise SystemExit(f"{', '.join(given)}: for an analytic --cost-model "
                             f"({', '.join(sorted(MODELS))}), not a cost table")
        if a.iteration_overhead is not None:
            over["iteration_overhead"] = a.iteration_overhead
    cost = make_cost_model(a.cost_model, a.gpu, **over)
    num_blocks = a.num_blocks
    if num_blocks is None:
        if not isinstance(cost, AnalyticCostModel):
            raise SystemExit("--num-blocks is required with a cost table")
        num_blocks = cost.num_kv_blocks()
    fields: dict[str, Any] = dict(
        policy=a.policy, num_blocks=num_blocks, block_size=a.block_size,
        max_batch_size=a.max_batch_size, max_batch_tokens=a.max_batch_tokens,
        max_model_len=a.max_model_len,
    )
    for kv in a.sched_opt:
        k, _, v = kv.partition("=")
        fields[k.strip()] = _json_value(v)
    return cost, SchedulerConfig.model_validate(fields)


def cluster_once(wl: Workload, cost: Any, sc: Any,
                  a: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    """Several replicas, autoscaled with --max-replicas (bench/cluster_sim.py)."""
    from bench.cluster_sim import ClusterOptions, simulate_cluster
    from scheduler.autoscale import AutoscaleSettings

    from scheduler.config import OfflinePoolConfig

    def opts_of(pairs: list[str], fields: dict[str, Any]) -> dict[str, Any]:
        for kv in pairs:
            k, _, v = kv.partition("=")
            fields[k.strip()] = _json_value(v)
        return fields

    scale: dict[str, Any] = {}
    if a.max_replicas is not None:
        scale = opts_of(a.autoscale_opt, dict(enabled=True, min_replicas=a.replicas,
                                              max_replicas=a.max_replicas))
    given = {k: getattr(a, k) for k in ("startup_s", "ttft_slo_s") if getattr(a, k) is not None}
    opts = ClusterOptions(replicas=a.replicas, autoscaling=AutoscaleSettings(**scale), **given,
                          overlap_swap=a.overlap_swap,
                          offline_pool=OfflinePoolConfig(**opts_of(a.offline_pool_opt, {})))
    out = simulate_cluster(wl.requests, sc, cost, opts)
    return out.records, {"options": opts.model_dump(), "replica_seconds": out.replica_seconds,
                         "end_time": out.end_time, "timeline": out.timeline, **out.stats}
