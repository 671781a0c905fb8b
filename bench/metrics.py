"""Serving metrics, named and defined as the field names them.

Computed from `RequestRecord`s only, so a live run and a simulated run are
measured by the same code.  Definitions follow vLLM's `benchmark_serving.py`
(and the seeds where they name a metric):

- TTFT, time to first token: first token's arrival - send time.
- TPOT, time per output token, excluding the first:
  (E2E - TTFT) / (output tokens - 1), for requests with > 1 output token.
- ITL, inter-token latency: every gap between consecutive token arrivals of
  a request, pooled over all requests.
- E2E latency: end of the response - send time.
- Normalized latency: E2E / output tokens, in s/token; its mean is the
  seeds' "average per-token latency" (FastServe §6.1, Orca, vLLM).
- Request throughput: completed requests / duration; output token
  throughput: output tokens of completed requests / duration; total token
  throughput adds their prompt tokens.  Duration runs from the first
  scheduled arrival to the last response end.
- SLO attainment: share of all requests (failed ones count as misses) that
  completed and met every given SLO (TTFT, TPOT, E2E, normalized latency);
  goodput: such requests per second of duration (vLLM's request goodput).
  FastServe Figure 13's "P95 goodput" is the highest rate whose attainment
  is >= 95%, a sweep-level figure (bench/sweep.py).
- Admission control: a request the server refused with HTTP 429 is
  "rejected", neither completed nor failed; the rejected share is over
  all requests, and every latency above is over admitted requests that
  completed.  Rejection latency is how long the refusal took (a server
  protecting itself says no at once); Retry-After is what it asked for.
  Requests the client dropped on purpose (disconnect tests) are counted
  apart as well.  Failures are grouped by kind (`error_kind`).
- Latency breakdown (FastServe Figures 1 and 15b): queueing, execution and
  swapping time, from server metadata or the simulator (when a server
  reports only queueing and swap time, execution is the rest of E2E);
  shares are sums of each component over the sum of E2E latencies.

Each latency distribution reports mean / median / P95 / P99 (numpy's
linear-interpolation percentiles, as vLLM).  All times in seconds.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from bench.records import RequestRecord


class Dist(BaseModel):
    """Summary of one latency distribution (seconds); None when empty."""

    model_config = ConfigDict(extra="forbid")

    count: int = 0
    mean: float | None = None
    median: float | None = None
    p95: float | None = None
    p99: float | None = None
    std: float | None = None
    min: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> "Dist":
        a = np.fromiter(values, dtype=float)
        if a.size == 0:
            return cls()
        p50, p95, p99 = np.percentile(a, [50, 95, 99])
        return cls(
            count=int(a.size),
            mean=float(a.mean()),
            median=float(p50),
            p95=float(p95),
            p99=float(p99),
            std=float(a.std()),
            min=float(a.min()),
            max=float(a.max()),
        )


class SLOSpec(BaseModel):
    """Per-request latency objectives in seconds; None = not constrained."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft: float | None = Field(None, gt=0)
    tpot: float | None = Field(None, gt=0)
    e2e: float | None = Field(None, gt=0)
    normalized_latency: float | None = Field(None, gt=0)

    @property
    def empty(self) -> bool:
        return all(v is None for v in self.model_dump().values())


class LatencyBreakdown(BaseModel):
    """Where E2E latency went (FastServe Figures 1, 15b)."""

    model_config = ConfigDict(extra="forbid")

    count: int
    mean_queueing: float
    mean_execution: float
    mean_swap: float
    queueing_share: float
    execution_share: float
    swap_share: float


class MetricsSummary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_requests: int
    num_completed: int
    # Errors only: neither refusals (429) nor drops by the client.
    num_failed: int
    num_rejected: int = 0
    rejected_share: float = 0.0
    num_dropped: int = 0
    errors_by_kind: dict[str, int] = Field(default_factory=dict)
    duration: float
    request_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2e: Dist
    normalized_latency: Dist
    slo: SLOSpec | None = None
    num_meeting_slo: int | None = None
    slo_attainment: float | None = None
    goodput: float | None = None
    num_preemptions: int | None = None
    swap_bytes: int | None = None
    breakdown: LatencyBreakdown | None = None
    # Of rejected requests: time to the 429, and the Retry-After asked for.
    rejection_latency: Dist = Field(default_factory=Dist)
    retry_after: Dist = Field(default_factory=Dist)
    by_class: dict[str, "MetricsSummary"] = Field(default_factory=dict)


_HTTP_STATUS = re.compile(r"\bHTTP (\d{3})\b")


def error_kind(error: str) -> str:
    """A failure's kind, for counting: "HTTP 500", "timeout", the exception
    class ("ReadError", "RemoteProtocolError"), "not sent", ..."""
    m = _HTTP_STATUS.search(error)
    if m:
        return f"HTTP {m.group(1)}"
    if error.startswith("not sent"):
        return "not sent"
    head, sep, _ = error.partition(":")
    return head.strip() if sep and " " not in head.strip() else error[:60]


def tpot(r: RequestRecord) -> float | None:
    """(E2E - TTFT) / (output tokens - 1); None for < 2 tokens."""
    e2e, ttft = r.e2e, r.ttft
    if e2e is None or ttft is None or r.output_tokens < 2:
        return None
    return (e2e - ttft) / (r.output_tokens - 1)


def normalized_latency(r: RequestRecord) -> float | None:
    e2e = r.e2e
    if e2e is None or r.output_tokens <= 0:
        return None
    return e2e / r.output_tokens


def itls(r: RequestRecord) -> np.ndarray:
    return np.diff(np.asarray(r.token_times, dtype=float))


def meets_slo(r: RequestRecord, slo: SLOSpec) -> bool:
    if not r.ok:
        return False
    checks = (
        ("ttft", slo.ttft, r.ttft),
        ("e2e", slo.e2e, r.e2e),
        ("tpot", slo.tpot, tpot(r)),
        ("normalized_latency", slo.normalized_latency, normalized_latency(r)),
    )
    for name, bound, value in checks:
        if bound is None:
            continue
        if value is None:
            # TPOT is undefined for one-token outputs: nothing to violate.
            if name == "tpot":
                continue
            return False
        if value > bound:
            return False
    return True


def duration_of(records: Sequence[RequestRecord]) -> float:
    if not records:
        return 0.0
    start = min(r.scheduled_time for r in records)
    ends = [
        r.end_time if r.end_time is not None else (r.token_times[-1] if r.token_times else r.send_time)
        for r in records
    ]
    return max(max(ends) - start, 0.0)


def tokens_per_s_while(records: Sequence[RequestRecord], job_class: str,
                       end: float, start: float = 0.0) -> tuple[float, float]:
    """(tokens/s, window) of `job_class`'s streamed tokens from `start` (the
    run's start by default) to `end`, or to its last token if that comes
    first: batch work's throughput while the online stream lasts (ConServe
    §6.2), without the tail where it runs alone.  A later `start` leaves out
    the warm-up, while the online jobs in flight build up to their steady
    number (more of them, for longer, where online work is served slower)."""
    times = [t for r in records if r.job_class == job_class for t in r.token_times]
    if not times:
        return 0.0, 0.0
    window = min(end, max(times)) - start
    if window <= 0:
        return 0.0, 0.0
    n = sum(1 for t in times if start <= t <= start + window)
    return n / window, window


def breakdown_of(records: Sequence[RequestRecord]) -> LatencyBreakdown | None:
    rows = []
    for r in records:
        e2e = r.e2e
        if not r.ok or r.queueing_time is None or e2e is None:
            continue
        swap = r.swap_time or 0.0
        # A server that reports only its queueing time: the rest executed.
        ex = r.execution_time if r.execution_time is not None else max(0.0, e2e - r.queueing_time - swap)
        rows.append((r.queueing_time, ex, swap, e2e))
    if not rows:
        return None
    a = np.asarray(rows, dtype=float)
    total = a[:, 3].sum()
    share = a[:, :3].sum(axis=0) / total if total > 0 else np.zeros(3)
    return LatencyBreakdown(
        count=len(rows),
        mean_queueing=float(a[:, 0].mean()),
        mean_execution=float(a[:, 1].mean()),
        mean_swap=float(a[:, 2].mean()),
        queueing_share=float(share[0]),
        execution_share=float(share[1]),
        swap_share=float(share[2]),
    )


def _sum_known(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return int(sum(known)) if known else None


def summarize(
    records: Sequence[RequestRecord],
    slo: SLOSpec | None = None,
    *,
    duration: float | None = None,
    by_class: bool = True,
) -> MetricsSummary:
    """All metrics of one run.  `duration` overrides the records' span."""
    done = [r for r in records if r.ok]
    rejected = [r for r in records if r.rejected]
    num_dropped = sum(r.dropped is not None for r in records)
    kinds: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            k = error_kind(r.error)
            kinds[k] = kinds.get(k, 0) + 1
    dur = duration_of(records) if duration is None else duration
    rate = (lambda x: x / dur) if dur > 0 else (lambda x: 0.0)
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    s = MetricsSummary(
        num_requests=len(records),
        num_completed=len(done),
        num_failed=len(records) - len(done) - len(rejected) - num_dropped,
        num_rejected=len(rejected),
        rejected_share=len(rejected) / len(records) if records else 0.0,
        num_dropped=num_dropped,
        errors_by_kind=dict(sorted(kinds.items())),
        duration=dur,
        request_throughput=rate(len(done)),
        output_token_throughput=rate(out_tokens),
        total_token_throughput=rate(out_tokens + in_tokens),
        ttft=Dist.of(x for r in done if (x := r.ttft) is not None),
        tpot=Dist.of(x for r in done if (x := tpot(r)) is not None),
        itl=Dist.of(np.concatenate([itls(r) for r in done]) if done else []),
        e2e=Dist.of(x for r in done if (x := r.e2e) is not None),
        normalized_latency=Dist.of(
            x for r in done if (x := normalized_latency(r)) is not None
        ),
        num_preemptions=_sum_known(r.num_preemptions for r in records),
        swap_bytes=_sum_known(r.swap_bytes for r in records),
        breakdown=breakdown_of(records),
        rejection_latency=Dist.of(x for r in rejected if (x := r.e2e) is not None),
        retry_after=Dist.of(r.retry_after for r in rejected if r.retry_after is not None),
    )
    if slo is not None and not slo.empty:
        met = sum(meets_slo(r, slo) for r in records)
        s.slo = slo
        s.num_meeting_slo = met
        s.slo_attainment = met / len(records) if records else None
        s.goodput = rate(met)
    classes = sorted({r.job_class for r in records})
    if by_class and len(classes) > 1:
        s.by_class = {
            c: summarize(
                [r for r in records if r.job_class == c], slo, duration=dur, by_class=False
            )
            for c in classes
        }
    return s


def format_summary(s: MetricsSummary, title: str = "") -> str:
    """A vLLM-style text table (latencies in ms)."""
    lines = [f"{'=' * 16} {title or 'Serving Benchmark Result'} {'=' * 16}"]

    def row(name: str, value: object) -> None:
        lines.append(f"{name:<44}{value:>14}")

    row("Requests (completed / failed):", f"{s.num_completed} / {s.num_failed}")
    if s.num_rejected:
        row("Rejected (429):", f"{s.num_rejected} ({100 * s.rejected_share:.1f}%)")
        if s.retry_after.mean is not None:
            row("Mean Retry-After (s):", f"{s.retry_after.mean:.2f}")
    if s.num_dropped:
        row("Dropped by the client:", s.num_dropped)
    for kind, n in s.errors_by_kind.items():
        row(f"  error {kind[:34]}:", n)
    row("Duration (s):", f"{s.duration:.2f}")
    row("Request throughput (req/s):", f"{s.request_throughput:.3f}")
    row("Output token throughput (tok/s):", f"{s.output_token_throughput:.1f}")
    row("Total token throughput (tok/s):", f"{s.total_token_throughput:.1f}")
    if s.slo_attainment is not None:
        row("SLO attainment (%):", f"{100 * s.slo_attainment:.1f}")
        row("Goodput (req/s):", f"{s.goodput:.3f}")
    for name, d, unit, k in (
        ("TTFT", s.ttft, "ms", 1e3),
        ("TPOT", s.tpot, "ms", 1e3),
        ("ITL", s.itl, "ms", 1e3),
        ("E2E", s.e2e, "ms", 1e3),
        ("Normalized latency", s.normalized_latency, "ms/token", 1e3),
    ):
        if d.count == 0:
            continue
        lines.append(f"{'-' * 10} {name} {'-' * 10}")
        for stat in ("mean", "median", "p95", "p99"):
            row(f"{stat.capitalize()} {name} ({unit}):", f"{getattr(d, stat) * k:.2f}")
    if s.num_preemptions is not None:
        row("Preemptions:", s.num_preemptions)
    if s.swap_bytes is not None:
        row("Swap bytes:", s.swap_bytes)
    if s.breakdown is not None:
        b = s.breakdown
        lines.append(f"{'-' * 10} Latency breakdown {'-' * 10}")
        row("Queueing share (%):", f"{100 * b.queueing_share:.1f}")
        row("Execution share (%):", f"{100 * b.execution_share:.1f}")
        row("Swapping share (%):", f"{100 * b.swap_share:.1f}")
    lines.append("=" * (34 + len(title or "Serving Benchmark Result")))
    for c, sub in s.by_class.items():
        lines.append(format_summary(sub, f"class {c}"))
    return "\n".join(lines)
