"""PNG plots of sweep results, in the style of the FastServe figures.

- `latency_vs_rate`: mean normalized latency (s/token) against job arrival
  rate, one line per system, with the SLO as a dashed line (Figure 11).
- the same with P95 (Figure 12), or any other metric / statistic.
- `attainment_vs_rate`: SLO attainment (%) against rate (Figure 13).
- `breakdown_bars`: stacked shares of queueing / execution / swapping time
  in E2E latency per rate or per run (Figures 1 and 15b).

Inputs are `SweepResult`s (a single run is a one-point sweep), so live and
simulated results of any system plot together.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.results import SweepResult  # noqa: E402


def _label(s: SweepResult) -> str:
    return s.system if s.mode == "live" else f"{s.system} (sim)"


def _series(s: SweepResult, metric: str, stat: str | None) -> tuple[list[float], list[float]]:
    xs: list[float] = []
    ys: list[float] = []
    for p in sorted(s.points, key=lambda p: p.meta.rate or 0.0):
        obj: object = getattr(p.summary, metric)
        if stat is not None:
            obj = getattr(obj, stat)
        if p.meta.rate is None or obj is None:
            continue
        xs.append(p.meta.rate)
        ys.append(float(obj))  # type: ignore[arg-type]
    return xs, ys


def latency_vs_rate(
    sweeps: Sequence[SweepResult],
    path: Path,
    *,
    metric: str = "normalized_latency",
    stat: str = "mean",
    slo: float | None = None,
    title: str | None = None,
) -> Path:
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for s in sweeps:
        xs, ys = _series(s, metric, stat)
        ax.plot(xs, ys, marker="o", markersize=3, label=_label(s))
    if slo is not None:
        ax.axhline(slo, color="gray", linestyle="--", linewidth=1, label="SLO")
    unit = "s/token" if metric == "normalized_latency" else "s"
    name = {"normalized_latency": "Latency", "e2e": "E2E latency", "ttft": "TTFT",
            "tpot": "TPOT", "itl": "ITL"}.get(metric, metric)
    prefix = "" if stat == "mean" else f"{stat.upper()} "
    ax.set_xlabel("Job Arrival Rate (job/s)")
    ax.set_ylabel(f"{prefix}{name} ({unit})")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    if slo is not None and any(
        y > slo * 1.7 for s in sweeps for y in _series(s, metric, stat)[1]
    ):
        # Clip runaway points above the SLO, as FastServe's figures do.
        ax.set_ylim(0, slo * 1.7)
    return _save(fig, ax, path, title)


def _save(fig: Any, ax: Any, path: Path, title: str | None) -> Path:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def attainment_vs_rate(sweeps: Sequence[SweepResult], path: Path, title: str | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for s in sweeps:
        xs, ys = _series(s, "slo_attainment", None)
        ax.plot(xs, [100 * y for y in ys], marker="o", markersize=3, label=_label(s))
    ax.set_xlabel("Job Arrival Rate (job/s)")
    ax.set_ylabel("SLO Attainment (%)")
    ax.set_ylim(0, 105)
    ax.set_xlim(left=0)
    return _save(fig, ax, path, title)


def breakdown_bars(sweeps: Sequence[SweepResult], path: Path, title: str | None = None) -> Path | None:
    """Stacked queueing / execution / swapping shares, one bar per point."""
    labels: list[str] = []
    rows: list[tuple[float, float, float]] = []
    many = len(sweeps) > 1
    for s in sweeps:
        for p in sorted(s.points, key=lambda p: p.meta.rate or 0.0):
            b = p.summary.breakdown
            if b is None:
                continue
            x = f"load={p.meta.load:.2f}" if p.meta.load is not None else f"{p.meta.rate or 0:.2f}/s"
            labels.append(f"{textwrap.fill(s.system, 14)}\n{x}" if many else x)
            rows.append((b.queueing_share, b.execution_share, b.swap_share))
    if not rows:
        return None
    width = (1.1 if many else 0.6) * len(rows) + 1.5
    fig, ax = plt.subplots(figsize=(max(4.0, width), 3.8))
    bottom = [0.0] * len(rows)
    for k, (name, color) in enumerate(
        (("Queuing Delay", "#d62728"), ("Execution Time", "#1f77b4"), ("Swapping", "#2ca02c"))
    ):
        vals = [100 * r[k] for r in rows]
        bars = ax.bar(range(len(rows)), vals, bottom=bottom, label=name, color=color)
        if k < 2:
            for rect, v, b0 in zip(bars, vals, bottom):
                if v >= 6:
                    ax.text(rect.get_x() + rect.get_width() / 2, b0 + v / 2, f"{v:.1f}",
                            ha="center", va="center", fontsize=7, color="white")
        bottom = [b0 + v for b0, v in zip(bottom, vals)]
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=0 if len(rows) < 8 else 45)
    ax.set_ylabel("Time Breakdown (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 1.18), ncol=3)
    if title:
        ax.set_title(title, fontsize=9, pad=24)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(
    sweeps: Sequence[SweepResult], out_dir: Path, *, slo: float | None = None, prefix: str = ""
) -> list[Path]:
    """Every standard plot of these sweeps into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    made = [
        latency_vs_rate(sweeps, out_dir / f"{prefix}latency_vs_rate.png", slo=slo),
        latency_vs_rate(sweeps, out_dir / f"{prefix}p95_latency_vs_rate.png", stat="p95", slo=slo),
        latency_vs_rate(sweeps, out_dir / f"{prefix}ttft_p99_vs_rate.png", metric="ttft", stat="p99"),
    ]
    if any(p.summary.slo_attainment is not None for s in sweeps for p in s.points):
        made.append(attainment_vs_rate(sweeps, out_dir / f"{prefix}slo_attainment_vs_rate.png"))
    b = breakdown_bars(sweeps, out_dir / f"{prefix}latency_breakdown.png")
    if b is not None:
        made.append(b)
    return made
