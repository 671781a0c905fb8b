"""What the robustness commands (`overload`, `disconnects`, `soak`,
`transparency`) share: time-bounded workloads, the model name resolved once,
the wait for an idle server and a last request that proves it still answers,
and how results are written."""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import math
from pathlib import Path
from typing import Sequence

import httpx
from pydantic import BaseModel, ConfigDict, Field

from bench.client import ClientConfig, discover_model, run_requests
from bench.records import RequestRecord
from bench.server_stats import KVSnapshot, LeakReport, StatsSource, wait_for_idle
from bench.workload import RequestSpec, WorkloadSpec, filler_prompt


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class CheckResult(BaseModel):
    """What every robustness result starts with (its `kind` set by each)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = 1
    created: str = Field(default_factory=now_iso)
    base_url: str
    model: str


class IdleCheckedResult(CheckResult):
    """A check that ends as `finish_check` does: the server idle again with
    nothing leaked (None with --no-server-stats), and a last request served."""

    kv: LeakReport | None = None
    health_check_error: str | None = None
    problems: list[str] = Field(default_factory=list)
    records: list[RequestRecord] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def finish_check(cfg: ClientConfig, stats: StatsSource | None, before: KVSnapshot | None,
                 idle_timeout: float, problems: list[str]) -> tuple[LeakReport | None, str | None]:
    """Wait for the server to go idle and compare its KV with `before` (where
    its stats can be read), then send one short request; what went wrong is
    added to `problems`.  Returns the leak report and the last request's
    failure (None: served)."""
    kv = None
    if stats is not None and before is not None:
        kv = wait_for_idle(stats, before, idle_timeout)
        problems += kv.problems
    health = still_serves(cfg)
    if health is not None:
        problems.append(f"the server no longer serves: {health}")
    return kv, health


def add_check_output_args(q: argparse.ArgumentParser, idle_timeout: float) -> None:
    q.add_argument("--idle-timeout", type=float, default=idle_timeout,
                   help="seconds to wait for the server to return to idle")
    q.add_argument("--out", type=Path, default=None, help="result JSON path")
    q.add_argument("--save-records", action="store_true", help="keep per-request records")


def spec_for_duration(spec: WorkloadSpec, rate: float, duration: float) -> WorkloadSpec:
    """The workload with its first stream at `rate` and enough requests that
    arrivals cover `duration` seconds (cut with `within`): the Poisson count
    over the window plus a margin of several standard deviations."""
    expected = rate * duration
    n = int(math.ceil(expected + 6 * math.sqrt(expected) + 20))
    spec = spec.with_rate(rate)
    streams = list(spec.streams)
    streams[0] = streams[0].model_copy(update={"num_requests": n})
    return spec.model_copy(update={"streams": streams})


def within(requests: Sequence[RequestSpec], duration: float) -> list[RequestSpec]:
    """The requests that arrive before `duration`."""
    return [r for r in requests if r.arrival_time < duration]


def with_model(cfg: ClientConfig) -> ClientConfig:
    """`cfg` naming the served model (asked once, not in every phase)."""
    if cfg.model is not None:
        return cfg

    async def ask() -> str:
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        async with httpx.AsyncClient(headers=headers, timeout=30.0, trust_env=False) as c:
            return await discover_model(c, cfg.base_url)

    return cfg.model_copy(update={"model": asyncio.run(ask())})


def still_serves(cfg: ClientConfig, timeout_s: float = 60.0) -> str | None:
    """Send one short request; None if it completed, else what went wrong."""
    req = RequestSpec(request_id="health-check", arrival_time=0.0, prompt=filler_prompt(8),
                      prompt_tokens=8, output_tokens=4)
    rec = run_requests([req], cfg.model_copy(update={"request_timeout": timeout_s,
                                                     "max_duration": None,
                                                     "max_concurrency": None})).records[0]
    if rec.ok:
        return None
    return "rejected (429)" if rec.rejected else (rec.error or "did not complete")


def save_check(result: BaseModel, path: Path | None, keep_records: bool) -> None:
    """Write a robustness result (without its per-request records unless
    asked: they are most of its size) and say where."""
    if path is None:
        return
    kept = result if keep_records else result.model_copy(update={"records": None})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(kept.model_dump_json(indent=1), encoding="utf-8")
    print(f"wrote {path}")


def plot_path(out: Path | None, plot: Path | None, default: Path) -> Path:
    """Where the plot goes: `--plot`, else beside `--out`, else `default`."""
    if plot is not None:
        return plot
    return out.with_suffix(".png") if out is not None else default
