"""The JSON result schema: one run, or a sweep of runs over arrival rates.

Live runs and simulated runs write the same schema (`meta.mode` tells them
apart), so results of different systems, of our server and of the simulator
can be compared and plotted together (`python -m bench plot a.json b.json`).
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from bench.metrics import MetricsSummary
from bench.records import RequestRecord
from bench.workload import WorkloadSpec

SCHEMA_VERSION = 1


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class RunMeta(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["live", "sim"]
    # Label of the system under test; one line per system in the plots.
    system: str
    workload: WorkloadSpec
    # Arrival rate of the first stream (req/s) and, when known, the load
    # (rate / saturated capacity, FastServe Figure 1's "load").
    rate: float | None = None
    load: float | None = None
    created: str = Field(default_factory=_now)
    # Endpoint and model of a live run; scheduler config, cost model and
    # simulation wall time of a simulated one; server-wide counters.
    details: dict[str, Any] = Field(default_factory=dict)


class RunResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["run"] = "run"
    schema_version: int = SCHEMA_VERSION
    meta: RunMeta
    summary: MetricsSummary
    records: list[RequestRecord] | None = None

    def without_records(self) -> "RunResult":
        return self.model_copy(update={"records": None})


class SweepResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["sweep"] = "sweep"
    schema_version: int = SCHEMA_VERSION
    system: str
    mode: Literal["live", "sim"]
    points: list[RunResult]
    # e.g. "normalized_latency.mean<=0.3" and the highest rate meeting it.
    criterion: str | None = None
    max_rate: float | None = None
    # Saturated throughput (req/s) that loads were measured against.
    capacity: float | None = None
    # Rates whose run completed under 95 % of the offered rate
    # (bench/sweep.py, `is_stable`): never a maximum rate.
    unstable_rates: list[float] = Field(default_factory=list)
    created: str = Field(default_factory=_now)


Result = RunResult | SweepResult
_ADAPTER: TypeAdapter[Result] = TypeAdapter(Result)


def save_result(result: Result, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(result.model_dump_json(indent=1), encoding="utf-8")


def load_result(path: Path) -> Result:
    return _ADAPTER.validate_json(path.read_bytes())


def as_sweep(result: Result) -> SweepResult:
    """A single run as a one-point sweep, so plots take either."""
    if isinstance(result, SweepResult):
        return result
    return SweepResult(
        system=result.meta.system, mode=result.meta.mode, points=[result.without_records()]
    )


def merge_sweeps(results: list[Result]) -> SweepResult:
    """One system's runs and sweeps as one sweep, points in rate order (runs
    taken one at a time, e.g. interleaved with another system's to cancel a
    machine's drift)."""
    sweeps = [as_sweep(r) for r in results]
    if not sweeps:
        raise ValueError("nothing to merge")
    systems = {(s.system, s.mode) for s in sweeps}
    if len(systems) != 1:
        raise ValueError(f"results of different systems or modes: {sorted(systems)}")
    points = sorted((p for s in sweeps for p in s.points), key=lambda p: p.meta.rate or 0.0)
    return SweepResult(system=sweeps[0].system, mode=sweeps[0].mode, points=points)
