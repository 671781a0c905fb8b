"""`python -m bench overload`: offer several times the server's capacity.

For `--duration` seconds, requests arrive open loop (Poisson) at
`--factor` x capacity, with the usual workload (ShareGPT lengths by
default; `--rate` and `-n` follow from capacity and duration).  Capacity
is `--capacity` (req/s) or measured first by a saturated probe:
`--probe-requests` requests all sent at t = 0, capacity = completed
requests / time until the last one completed (the probe's time limit if
some were cut off); a request refused with 429 is sent again after its
Retry-After, so that admission control does not cut the probe's batch.

A server that protects itself keeps completing at about its capacity,
refuses the rest quickly with 429, fails nothing, and its memory stays
flat.  Requests still open `--drain-timeout` seconds after the end of the
`--duration` window (duration + drain timeout from the start) are cut off
(and count as failures).

Reported: offered and completed rates, the 429 share, failures by kind,
TTFT and TPOT (P50 / P99) of admitted requests, the client's send lag,
and the server's summed RSS (bench/rss.py) sampled every `--rss-interval`
seconds: start, peak, end.  Writes a JSON result and a plot of rates and
RSS over time; exits 1 if any request failed.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from bench.checks import CheckResult, plot_path, save_check, spec_for_duration, with_model, within
from bench.cli_args import _add_live_args, _add_output_args, _add_workload_args
from bench.client import ClientConfig, run_requests
from bench.metrics import MetricsSummary, format_summary, summarize
from bench.records import RequestRecord
from bench.rss import RssSampler, RssSeries, RssStats, check_pid
from bench.timeline import Timeline, timeline
from bench.workload import Workload, WorkloadSpec

Build = Callable[[WorkloadSpec], Workload]


class OverloadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    factor: float = Field(5.0, gt=0)
    duration: float = Field(60.0, gt=0)
    # req/s; None: measured by the probe.
    capacity: float | None = Field(None, gt=0)
    probe_requests: int = Field(32, ge=1)
    probe_timeout: float = Field(300.0, gt=0)
    drain_timeout: float = Field(120.0, gt=0)
    rss_interval: float = Field(1.0, gt=0)
    server_pid: int | None = None


class CapacityProbe(BaseModel):
    """The saturated probe: all requests at t = 0."""

    model_config = ConfigDict(extra="forbid")

    num_requests: int
    num_completed: int
    # Requests still refused when the probe ended, and 429s answered to
    # attempts that were sent again.
    num_rejected: int
    num_retried: int = 0
    elapsed_s: float
    req_per_s: float
    # Tokens of every stream, finished or not, per second, over the mean
    # asked-for output: a capacity figure the slowest request does not skew.
    output_tokens_per_s: float
    token_based_req_per_s: float


class Percentiles(BaseModel):
    model_config = ConfigDict(extra="forbid")

    p50: float | None = None
    p99: float | None = None


class OverloadResult(CheckResult):
    kind: Literal["overload"] = "overload"
    system: str
    config: OverloadConfig
    workload: WorkloadSpec
    capacity_req_per_s: float
    capacity_source: Literal["given", "probe"]
    probe: CapacityProbe | None = None
    target_rate: float  # factor x capacity
    # Requests sent over the window / window; completed requests / the run's
    # span (first arrival to last answer, the drain included), and those
    # that completed within the window / window.
    offered_rate: float
    completed_rate: float
    completed_rate_in_window: float
    num_requests: int
    num_completed: int
    num_rejected: int
    rejected_share: float
    num_failed: int
    errors_by_kind: dict[str, int]
    ttft: Percentiles  # admitted requests
    tpot: Percentiles
    # How late the client sent requests (s, P99): a high figure means the
    # client, not the server, limited the offered rate.
    send_lag_p99: float | None
    rss: RssStats
    rss_series: RssSeries
    timeline: Timeline
    summary: MetricsSummary
    problems: list[str] = Field(default_factory=list)
    records: list[RequestRecord] | None = None


def probe_capacity(wl: Workload, cfg: ClientConfig, timeout: float) -> CapacityProbe:
    reqs = [r.model_copy(update={"arrival_time": 0.0}) for r in wl.requests]
    # Refused requests are sent again after their Retry-After: under
    # admission control a burst at t = 0 is mostly refused, and capacity is
    # what the server completes while kept saturated, not what it admits
    # of one burst.
    live = run_requests(reqs, cfg.model_copy(update={
        "max_duration": timeout, "request_timeout": min(cfg.request_timeout, timeout),
        "retry_rejected": True}))
    done = [r for r in live.records if r.ok]
    # Until the last completion; until the time limit when some were cut off.
    unfinished = any(not r.ok and not r.rejected for r in live.records)
    last = max((r.end_time or 0.0) for r in done) if done and not unfinished else live.wall_time
    elapsed = max(last, 1e-9)
    tokens = sum(len(r.token_times) for r in live.records)
    mean_out = float(np.mean([r.output_tokens for r in reqs]))
    return CapacityProbe(
        num_requests=len(reqs), num_completed=len(done),
        num_rejected=sum(r.rejected for r in live.records),
        num_retried=sum(r.num_rejections for r in live.records), elapsed_s=elapsed,
        req_per_s=len(done) / elapsed, output_tokens_per_s=tokens / elapsed,
        token_based_req_per_s=tokens / elapsed / mean_out if mean_out > 0 else 0.0,
    )


def run_overload(spec: WorkloadSpec, build: Build, cfg: ClientConfig, oc: OverloadConfig,
                 system: str | None = None) -> OverloadResult:
    """`build(spec) -> Workload` makes the requests (ShareGPT pool loaded once)."""
    cfg = with_model(cfg)
    probe = None
    capacity = oc.capacity
    if capacity is None:
        # Another seed than the run's, first stream only (no offline mix).
        first = spec.with_rate(math.inf).streams[0].model_copy(
            update={"num_requests": oc.probe_requests})
        pspec = spec.model_copy(update={"seed": spec.seed + 1, "streams": [first]})
        probe = probe_capacity(build(pspec), cfg, oc.probe_timeout)
        print(f"capacity measured by a saturated probe: {probe.req_per_s:.3f} req/s "
              f"({probe.num_requests} requests at t=0, {probe.num_retried} 429s retried, "
              f"{probe.num_completed} completed in "
              f"{probe.elapsed_s:.1f} s; {probe.output_tokens_per_s:.1f} output tok/s)",
              flush=True)
        capacity = probe.req_per_s
        if capacity <= 0:
            raise SystemExit("the probe completed no request: give --capacity")
    rate = oc.factor * capacity
    run_spec = spec_for_duration(spec, rate, oc.duration)
    reqs = within(build(run_spec).requests, oc.duration)
    print(f"offering {rate:.3f} req/s ({oc.factor:g} x {capacity:.3f}) for {oc.duration:g} s: "
          f"{len(reqs)} requests", flush=True)
    run_cfg = cfg.model_copy(update={"max_duration": oc.duration + oc.drain_timeout})
    with RssSampler(oc.server_pid, oc.rss_interval) as sampler:
        live = run_requests(reqs, run_cfg)
    records = live.records
    s = summarize(records)
    in_window = sum(r.ok and (r.end_time or 0.0) <= oc.duration for r in records)
    lags = [r.send_time - r.scheduled_time for r in records
            if not (r.error or "").startswith("not sent")]
    problems = []
    if s.num_failed:
        problems.append(f"{s.num_failed} requests failed: {s.errors_by_kind}")
    return OverloadResult(
        system=system or f"live:{cfg.model}", base_url=cfg.base_url, model=cfg.model or "",
        config=oc, workload=run_spec, capacity_req_per_s=capacity,
        capacity_source="given" if probe is None else "probe", probe=probe,
        target_rate=rate, offered_rate=len(reqs) / oc.duration,
        completed_rate=s.request_throughput, completed_rate_in_window=in_window / oc.duration,
        num_requests=len(records),
        num_completed=s.num_completed, num_rejected=s.num_rejected,
        rejected_share=s.rejected_share, num_failed=s.num_failed,
        errors_by_kind=s.errors_by_kind,
        ttft=Percentiles(p50=s.ttft.median, p99=s.ttft.p99),
        tpot=Percentiles(p50=s.tpot.median, p99=s.tpot.p99),
        send_lag_p99=float(np.percentile(lags, 99)) if lags else None,
        rss=RssStats.of(sampler.series), rss_series=sampler.series,
        timeline=timeline(records), summary=s, problems=problems, records=records,
    )


def format_overload(r: OverloadResult) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1e3 * x:.1f}"

    def mb(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    lines = [
        f"capacity {r.capacity_req_per_s:.3f} req/s ({r.capacity_source}), "
        f"factor {r.config.factor:g}: target {r.target_rate:.3f} req/s",
        f"offered   {r.offered_rate:8.3f} req/s   completed {r.completed_rate:8.3f} req/s "
        f"over {r.summary.duration:.1f} s ({r.completed_rate_in_window:.3f} req/s within "
        f"the {r.config.duration:g} s window)",
        f"requests  {r.num_requests}: {r.num_completed} completed, {r.num_rejected} rejected "
        f"(429, {100 * r.rejected_share:.1f}%), {r.num_failed} failed {r.errors_by_kind or ''}",
        f"admitted  TTFT P50 {ms(r.ttft.p50)} ms, P99 {ms(r.ttft.p99)} ms; "
        f"TPOT P50 {ms(r.tpot.p50)} ms, P99 {ms(r.tpot.p99)} ms",
        f"client send lag P99 {ms(r.send_lag_p99)} ms",
        f"server RSS ({r.rss.source}): start {mb(r.rss.start_mb)} MB, "
        f"peak {mb(r.rss.peak_mb)} MB, end {mb(r.rss.end_mb)} MB",
    ]
    lines += [f"PROBLEM: {p}" for p in r.problems]
    return "\n".join(lines)


def cmd_overload(a: argparse.Namespace) -> int:
    from bench.cli_workload import _client_config, _PoolCache, _workload_spec
    from bench.plots_health import overload_plot

    check_pid(a.server_pid)
    oc = OverloadConfig(factor=a.factor, duration=a.duration, capacity=a.capacity,
                        probe_requests=a.probe_requests, probe_timeout=a.probe_timeout,
                        drain_timeout=a.drain_timeout, rss_interval=a.rss_interval,
                        server_pid=a.server_pid)
    pools = _PoolCache(a.tokenizer, need_text=True)
    res = run_overload(_workload_spec(a), pools.build, _client_config(a), oc, a.system)
    print(format_summary(res.summary, f"overload x{oc.factor:g}"))
    print(format_overload(res))
    save_check(res, a.out, a.save_records)
    png = overload_plot(res.timeline, res.rss_series, plot_path(
        a.out, a.plot, Path("runs/overload.png")),
        offered=res.offered_rate, capacity=res.capacity_req_per_s,
        title=f"{res.system}: x{oc.factor:g} capacity for {oc.duration:g} s")
    print(f"wrote {png}")
    return 1 if res.problems else 0


def add_overload_parser(sub: Any) -> None:
    q = sub.add_parser("overload", help="offer a multiple of the server's capacity; 429s, "
                                        "admitted latency, server RSS")
    _add_workload_args(q)
    _add_live_args(q)
    _add_output_args(q)
    g = q.add_argument_group("overload")
    g.add_argument("--factor", type=float, default=5.0, help="offered rate / capacity")
    g.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    g.add_argument("--capacity", type=float, default=None, metavar="REQ_PER_S",
                   help="the server's capacity; default: measure it by a saturated probe")
    g.add_argument("--probe-requests", type=int, default=32,
                   help="requests the probe sends at t=0")
    g.add_argument("--probe-timeout", type=float, default=300.0, help="probe time limit (s)")
    g.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds after the --duration window ends before open streams "
                        "are cut off")
    g.add_argument("--server-pid", type=int, default=None,
                   help="pid of `serve run`: its process tree is the server for RSS "
                        "(default: the Ray processes of the local session)")
    g.add_argument("--rss-interval", type=float, default=1.0, help="seconds between RSS samples")
    g.add_argument("--plot", type=Path, default=None, help="PNG path (default: beside --out)")
    q.set_defaults(func=cmd_overload)
