"""`python -m bench soak`: hours of ordinary traffic; does anything grow?

Runs the usual workload (ShareGPT, Poisson at `--rate`, online) for
`--duration` seconds (the request count follows from both; `-n` is
unused), with a mix of request kinds a real client sends (each a share of
the requests, disjoint): `n` > 1 choices, stop strings
(min_tokens left out so they can fire), logprobs, and clients that hang up
early (at a random phase: after sending, before the first token, after a
few streamed chunks).  Every `--sample-interval` seconds it samples the server's
summed RSS (bench/rss.py) and the engines' KV figures
(bench/server_stats.py).  At the end it waits for the server to go idle.

Reported: RSS after the warm-up (`--warmup` seconds, excluded from the
trend: caches, allocator pools and lazy imports fill up then) and at the
end, their difference and the least-squares slope in MB/hour after the
warm-up; completed requests, 429s, drops and failures by kind; KV blocks
and host-tier bytes that did not return to their idle values.  Writes a
JSON result and a plot of RSS and KV use over time; exits 1 on a leak, a
failed request or an RSS slope above `--max-rss-slope`.
"""

from __future__ import annotations

import argparse
import math
import threading
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from bench.checks import (
    IdleCheckedResult, plot_path, save_check, spec_for_duration, still_serves, with_model, within,
)
from bench.cli_args import _add_live_args, _add_output_args, _add_workload_args
from bench.client import ClientConfig, RequestVariant, run_requests
from bench.metrics import MetricsSummary, format_summary, summarize
from bench.records import DROP_PHASES
from bench.rss import PeriodicSampler, RssSampler, RssSeries, check_pid
from bench.server_stats import (
    KVSnapshot, StatsSource, add_stats_args, read_snapshot, stats_source,
    idle_start,
    wait_for_idle,
)
from bench.workload import RequestSpec, Workload, WorkloadSpec


class SoakMix(BaseModel):
    """Shares of requests that depart from a plain streamed completion."""

    model_config = ConfigDict(extra="forbid")

    share_n: float = Field(0.05, ge=0, le=1)
    n: int = Field(2, ge=2)
    share_stop: float = Field(0.05, ge=0, le=1)
    stop: list[str] = Field(default_factory=lambda: [".", "\n"])
    share_logprobs: float = Field(0.05, ge=0, le=1)
    top_logprobs: int = Field(5, ge=0)
    share_disconnect: float = Field(0.05, ge=0, le=1)
    max_drop_chunks: int = Field(32, ge=1)

    @model_validator(mode="after")
    def _sum(self) -> "SoakMix":
        if self.share_n + self.share_stop + self.share_logprobs + self.share_disconnect > 1:
            raise ValueError("the mix shares add up to more than 1")
        return self


class SoakConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    duration: float = Field(1800.0, gt=0)
    warmup: float = Field(120.0, ge=0)
    sample_interval: float = Field(5.0, gt=0)
    idle_timeout: float = Field(120.0, gt=0)
    drain_timeout: float = Field(600.0, gt=0)
    server_pid: int | None = None
    # Fail when RSS grows faster than this after the warm-up (MB/hour).
    max_rss_slope: float | None = None
    mix: SoakMix = SoakMix()


class RssGrowth(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str
    start_after_warmup_mb: float | None
    end_mb: float | None
    peak_mb: float | None
    growth_mb: float | None
    slope_mb_per_hour: float | None


class SoakResult(IdleCheckedResult):
    kind: Literal["soak"] = "soak"
    system: str
    config: SoakConfig
    workload: WorkloadSpec
    # Requests of each mix kind ("plain", "n", "stop", "logprobs", "disconnect").
    mix_counts: dict[str, int]
    num_requests: int
    num_completed: int
    num_rejected: int
    num_dropped: int
    num_failed: int
    errors_by_kind: dict[str, int]
    rss: RssGrowth
    rss_series: RssSeries
    kv_samples: list[KVSnapshot] = Field(default_factory=list)
    summary: MetricsSummary


def mix_variants(reqs: list[RequestSpec], mix: SoakMix, endpoint: str,
                 seed: int) -> tuple[dict[str, RequestVariant], dict[str, int]]:
    """Each request's kind, drawn under the seed; the variants and counts."""
    rng = np.random.default_rng([seed, 7])
    u = rng.random(len(reqs))
    phase = rng.integers(0, len(DROP_PHASES), size=len(reqs))
    chunks = rng.integers(1, mix.max_drop_chunks + 1, size=len(reqs))
    logprobs: dict[str, Any] = ({"logprobs": True, "top_logprobs": mix.top_logprobs}
                                if endpoint == "chat" else {"logprobs": mix.top_logprobs})
    edges = np.cumsum([mix.share_n, mix.share_stop, mix.share_logprobs, mix.share_disconnect])
    variants: dict[str, RequestVariant] = {}
    counts = {"plain": 0, "n": 0, "stop": 0, "logprobs": 0, "disconnect": 0}
    for i, r in enumerate(reqs):
        k = int(np.searchsorted(edges, u[i], side="right"))
        if k == 0:
            variants[r.request_id] = RequestVariant(extra_body={"n": mix.n})
        elif k == 1:
            variants[r.request_id] = RequestVariant(extra_body={"stop": mix.stop},
                                                    drop_keys=["min_tokens"])
        elif k == 2:
            variants[r.request_id] = RequestVariant(extra_body=logprobs)
        elif k == 3:
            p = DROP_PHASES[int(phase[i])]
            n = min(int(chunks[i]), max(r.output_tokens - 1, 1))
            variants[r.request_id] = RequestVariant(drop=p, drop_after_chunks=n)
        counts[("n", "stop", "logprobs", "disconnect", "plain")[min(k, 4)]] += 1
    return variants, counts


def rss_growth(series: RssSeries, warmup: float) -> RssGrowth:
    after = series.after(warmup)
    start = after[0].rss_mb if after else None
    end = series.end_mb
    return RssGrowth(
        source=series.source, start_after_warmup_mb=start, end_mb=end, peak_mb=series.peak_mb,
        growth_mb=end - start if start is not None and end is not None else None,
        slope_mb_per_hour=series.slope_mb_per_hour(warmup),
    )


def run_soak(spec: WorkloadSpec, build: Callable[[WorkloadSpec], Workload], cfg: ClientConfig,
             sc: SoakConfig, stats: StatsSource | None, system: str | None = None) -> SoakResult:
    """`build(spec) -> Workload` makes the requests (ShareGPT pool loaded once)."""
    rate = spec.streams[0].arrivals.rate
    if not math.isfinite(rate):
        raise SystemExit("soak: --rate must be finite")
    cfg = with_model(cfg)
    run_spec = spec_for_duration(spec, rate, sc.duration)
    reqs = within(build(run_spec).requests, sc.duration)
    variants, counts = mix_variants(reqs, sc.mix, cfg.endpoint, spec.seed)
    problems: list[str] = []
    before = idle_start(stats, sc.idle_timeout, "soak")
    kv_samples: list[KVSnapshot] = []
    lock = threading.Lock()

    def sample_kv(t: float) -> None:
        if stats is not None:
            snap = read_snapshot(stats, t)
            with lock:
                kv_samples.append(snap)

    print(f"soak: {len(reqs)} requests at {rate:g} req/s for {sc.duration:g} s; mix {counts}",
          flush=True)
    run_cfg = cfg.model_copy(update={"max_duration": sc.duration + sc.drain_timeout})
    kv = None
    with RssSampler(sc.server_pid, sc.sample_interval) as rss, \
            PeriodicSampler(sample_kv, sc.sample_interval):
        live = run_requests(reqs, run_cfg, variants)
        if stats is not None:
            kv = wait_for_idle(stats, before, sc.idle_timeout)
            problems += kv.problems
    s = summarize(live.records)
    if s.num_failed:
        problems.append(f"{s.num_failed} requests failed: {s.errors_by_kind}")
    growth = rss_growth(rss.series, sc.warmup)
    if (sc.max_rss_slope is not None and growth.slope_mb_per_hour is not None
            and growth.slope_mb_per_hour > sc.max_rss_slope):
        problems.append(f"RSS grows {growth.slope_mb_per_hour:.1f} MB/h "
                        f"(limit {sc.max_rss_slope:g})")
    health = still_serves(cfg)
    if health is not None:
        problems.append(f"the server no longer serves: {health}")
    return SoakResult(
        system=system or f"live:{cfg.model}", base_url=cfg.base_url, model=cfg.model or "",
        config=sc, workload=run_spec, mix_counts=counts, num_requests=len(reqs),
        num_completed=s.num_completed, num_rejected=s.num_rejected, num_dropped=s.num_dropped,
        num_failed=s.num_failed, errors_by_kind=s.errors_by_kind, rss=growth,
        rss_series=rss.series, kv_samples=sorted(kv_samples, key=lambda k: k.t), kv=kv,
        health_check_error=health, summary=s, problems=problems, records=live.records,
    )


def format_soak(r: SoakResult) -> str:
    def mb(x: float | None, sign: str = "") -> str:
        return "-" if x is None else f"{x:{sign}.1f}"

    g = r.rss
    lines = [
        f"requests {r.num_requests} {r.mix_counts}: {r.num_completed} completed, "
        f"{r.num_rejected} rejected (429), {r.num_dropped} dropped on purpose, "
        f"{r.num_failed} failed {r.errors_by_kind or ''}",
        f"server RSS ({g.source}): {mb(g.start_after_warmup_mb)} MB after the "
        f"{r.config.warmup:g} s warm-up -> {mb(g.end_mb)} MB at the end "
        f"({mb(g.growth_mb, '+')} MB; slope {mb(g.slope_mb_per_hour, '+')} MB/h; "
        f"peak {mb(g.peak_mb)} MB)",
    ]
    if r.kv is not None:
        lines.append(f"KV after idle (waited {r.kv.waited_s:.1f} s): leaked blocks "
                     f"{r.kv.leaked_blocks or 0}, host-tier blocks {r.kv.leaked_host_blocks or 0},"
                     f" host bytes {r.kv.leaked_host_bytes}")
    else:
        lines.append("no server stats: leak check skipped")
    lines += [f"PROBLEM: {p}" for p in r.problems]
    lines.append("OK" if not r.problems else "FAILED")
    return "\n".join(lines)


def cmd_soak(a: argparse.Namespace) -> int:
    from bench.cli_workload import _client_config, _PoolCache, _workload_spec
    from bench.plots_health import soak_plot

    check_pid(a.server_pid)
    mix = SoakMix(share_n=a.share_n, n=a.n, share_stop=a.share_stop, stop=a.stop,
                  share_logprobs=a.share_logprobs, top_logprobs=a.top_logprobs,
                  share_disconnect=a.share_disconnect, max_drop_chunks=a.max_drop_chunks)
    sc = SoakConfig(duration=a.duration, warmup=a.warmup, sample_interval=a.sample_interval,
                    idle_timeout=a.idle_timeout, drain_timeout=a.drain_timeout,
                    server_pid=a.server_pid, max_rss_slope=a.max_rss_slope, mix=mix)
    pools = _PoolCache(a.tokenizer, need_text=True)
    res = run_soak(_workload_spec(a), pools.build, _client_config(a), sc, stats_source(a),
                   a.system)
    print(format_summary(res.summary, f"soak {sc.duration:g} s"))
    print(format_soak(res))
    save_check(res, a.out, a.save_records)
    png = soak_plot(res.rss_series, res.kv_samples,
                    plot_path(a.out, a.plot, Path("runs/soak.png")),
                    warmup_s=sc.warmup, slope_mb_per_hour=res.rss.slope_mb_per_hour,
                    title=f"{res.system}: soak at {res.workload.streams[0].arrivals.rate:g} "
                          f"req/s for {sc.duration:g} s")
    print(f"wrote {png}")
    return 0 if res.ok else 1


def add_soak_parser(sub: Any) -> None:
    q = sub.add_parser("soak", help="a long mixed run; RSS growth, errors, leaked KV")
    _add_workload_args(q)
    _add_live_args(q)
    _add_output_args(q)
    add_stats_args(q)
    g = q.add_argument_group("soak")
    g.add_argument("--duration", type=float, default=1800.0, help="seconds of arrivals")
    g.add_argument("--warmup", type=float, default=120.0,
                   help="seconds left out of the RSS start and trend")
    g.add_argument("--sample-interval", type=float, default=5.0,
                   help="seconds between RSS / KV samples")
    g.add_argument("--idle-timeout", type=float, default=120.0,
                   help="seconds to wait, at the end, for the server to return to idle")
    g.add_argument("--drain-timeout", type=float, default=600.0,
                   help="seconds after the --duration window ends before open streams "
                        "are cut off")
    g.add_argument("--server-pid", type=int, default=None,
                   help="pid of `serve run`: its process tree is the server for RSS "
                        "(default: the Ray processes of the local session)")
    g.add_argument("--max-rss-slope", type=float, default=None, metavar="MB_PER_HOUR",
                   help="fail when RSS grows faster than this after the warm-up")
    g.add_argument("--plot", type=Path, default=None, help="PNG path (default: beside --out)")
    g = q.add_argument_group("request mix (shares of all requests, disjoint)")
    g.add_argument("--share-n", type=float, default=0.05, help="requests with n > 1")
    g.add_argument("--n", type=int, default=2, help="their n")
    g.add_argument("--share-stop", type=float, default=0.05, help="requests with stop strings")
    g.add_argument("--stop", nargs="+", default=[".", "\n"], help="their stop strings")
    g.add_argument("--share-logprobs", type=float, default=0.05, help="requests with logprobs")
    g.add_argument("--top-logprobs", type=int, default=5)
    g.add_argument("--share-disconnect", type=float, default=0.05,
                   help="requests whose client hangs up early")
    g.add_argument("--max-drop-chunks", type=int, default=32,
                   help="mid-stream hang-ups come after 1 .. this many streamed chunks (a chunk "
                        "holds `stream_interval` tokens)")
    q.set_defaults(func=cmd_soak)
