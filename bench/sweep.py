"""Rate sweeps and the maximum rate that meets an SLO.

FastServe §6.1: "we set a latency SLO and compare the maximum throughput
each system can achieve under the SLO" -- with the SLO on mean per-token
(normalized) latency, 0.3 s for OPT-13B (10x one decode iteration), and in
Figure 13 on P95 goodput (the highest rate at which >= 95% of requests meet
TTFT and TPOT SLOs).  A `Criterion` expresses either:

    normalized_latency.mean<=0.3     (Figure 11's SLO line)
    normalized_latency.p95<=0.3      (Figure 12)
    slo_attainment>=0.95             (Figure 13, with --slo-ttft/--slo-tpot)

A sweep runs one system at a list of rates (live or simulated, through the
same `evaluate(rate) -> RunResult` callback) and reports the highest rate of
the grid below which every rate meets the criterion; with a simulator the
boundary can be refined by bisection (`bisect_max_rate`).

A rate counts only where the run was *stable*: it completed at least 95 %
of the offered rate (completed requests per second of the run over the
rate).  A finite run at several times its capacity can keep a mean under
the SLO while its queue grows without bound; such points are listed as
unstable and never give the maximum rate.
"""

from __future__ import annotations

import re
from typing import Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict

from bench.metrics import MetricsSummary
from bench.results import RunResult, SweepResult

_CRIT = re.compile(r"^\s*([a-z_][a-z0-9_.]*)\s*(<=|>=)\s*([-+0-9.eE]+)\s*$")

Evaluate = Callable[[float], RunResult]

# Completed / offered below this share: the queue grew during the run.
STABLE_SHARE = 0.95


def completed_share(point: RunResult) -> float | None:
    """Completed requests per second over the offered rate (None: no rate)."""
    rate = point.meta.rate
    if not rate:
        return None
    return point.summary.request_throughput / rate


def is_stable(point: RunResult) -> bool:
    share = completed_share(point)
    return share is None or share >= STABLE_SHARE


class Criterion(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: str  # dotted path into MetricsSummary
    op: Literal["<=", ">="]
    value: float

    @classmethod
    def parse(cls, text: str) -> "Criterion":
        m = _CRIT.match(text)
        if not m:
            raise ValueError(
                f"bad criterion {text!r}; expected e.g. 'normalized_latency.mean<=0.3' "
                "or 'slo_attainment>=0.95'"
            )
        c = cls(metric=m.group(1), op=m.group(2), value=float(m.group(3)))
        c.lookup(None)  # validates the path
        return c

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"

    def lookup(self, summary: MetricsSummary | None) -> float | None:
        obj: object = summary
        model: type[BaseModel] | None = MetricsSummary
        for part in self.metric.split("."):
            if model is None or part not in model.model_fields:
                raise ValueError(f"unknown metric {self.metric!r}")
            ann = model.model_fields[part].annotation
            model = next(
                (a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)),
                None,
            )
            obj = getattr(obj, part, None) if obj is not None else None
        if summary is None or obj is None:
            return None
        if not isinstance(obj, (int, float)):
            raise ValueError(f"metric {self.metric!r} is not a number")
        return float(obj)

    def holds(self, summary: MetricsSummary) -> bool:
        v = self.lookup(summary)
        if v is None:
            return False
        return v <= self.value if self.op == "<=" else v >= self.value


def max_rate_on_grid(points: Sequence[RunResult], criterion: Criterion) -> float | None:
    """Highest rate r of the grid such that every rate <= r meets `criterion`
    and was stable."""
    best: float | None = None
    for p in sorted(points, key=lambda p: p.meta.rate or 0.0):
        if not criterion.holds(p.summary) or not is_stable(p):
            break
        best = p.meta.rate
    return best


def run_sweep(
    rates: Sequence[float],
    evaluate: Evaluate,
    *,
    system: str,
    mode: Literal["live", "sim"],
    criterion: Criterion | None = None,
    capacity: float | None = None,
    on_point: Callable[[RunResult], None] | None = None,
) -> SweepResult:
    points: list[RunResult] = []
    for rate in sorted(rates):
        res = evaluate(rate)
        if on_point is not None:
            on_point(res)
        points.append(res.without_records())
    return SweepResult(
        system=system,
        mode=mode,
        points=points,
        criterion=str(criterion) if criterion else None,
        max_rate=max_rate_on_grid(points, criterion) if criterion else None,
        capacity=capacity,
        unstable_rates=[p.meta.rate for p in points if p.meta.rate and not is_stable(p)],
    )


def bisect_max_rate(
    evaluate: Evaluate,
    criterion: Criterion,
    lo: float,
    hi: float,
    *,
    iterations: int = 6,
    rel_tol: float = 0.02,
) -> tuple[float | None, list[RunResult]]:
    """Refine the highest rate meeting `criterion` between `lo` and `hi`.

    Assumes the criterion gets harder with rate; an unstable run fails it.  Returns (rate, the runs
    made); rate None when even `lo` fails.  `hi` is doubled (at most 4
    times) until it fails.
    """
    runs: list[RunResult] = []

    def ok(rate: float) -> bool:
        r = evaluate(rate)
        runs.append(r.without_records())
        return criterion.holds(r.summary) and is_stable(r)

    if not ok(lo):
        return None, runs
    for _ in range(4):
        if not ok(hi):
            break
        lo, hi = hi, hi * 2
    else:
        return lo, runs
    for _ in range(iterations):
        if hi - lo <= rel_tol * lo:
            break
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, runs
