"""How `python -m bench` reports: summaries, sweep tables, saved results, plots."""

from __future__ import annotations

import argparse

from bench.metrics import SLOSpec, format_summary
from bench.results import RunResult, SweepResult, save_result
from bench.sweep import completed_share, is_stable


def _emit(res: RunResult, a: argparse.Namespace, title: str) -> None:
    print(format_summary(res.summary, title))
    if a.out is not None:
        save_result(res if a.save_records else res.without_records(), a.out)
        print(f"wrote {a.out}")


def _share(p: RunResult) -> str:
    share = completed_share(p)
    if share is None:
        return "-"
    return f"{100 * share:.0f}%" + ("" if is_stable(p) else "*")


def _sweep_table(sweep: SweepResult) -> str:
    lines = [f"{'rate':>8} {'load':>6} {'done':>6} {'thr':>7} {'done/off':>9} {'mean NL':>9} "
             f"{'p95 NL':>9} {'p99 TTFT':>9} {'queue%':>7} {'attain%':>8}"]
    for p in sweep.points:
        s = p.summary
        nl = s.normalized_latency
        b = s.breakdown
        lines.append(
            f"{p.meta.rate or 0:8.3f} {p.meta.load if p.meta.load is not None else float('nan'):6.2f} "
            f"{s.num_completed:6d} {s.request_throughput:7.3f} "
            f"{_share(p):>9} {(nl.mean or 0):9.4f} {(nl.p95 or 0):9.4f} {(s.ttft.p99 or 0):9.3f} "
            f"{(100 * b.queueing_share if b else float('nan')):7.1f} "
            f"{(100 * s.slo_attainment if s.slo_attainment is not None else float('nan')):8.1f}"
        )
    lines.append("* unstable: completed under 95% of the offered rate (never a max rate)")
    if sweep.criterion:
        lines.append(f"max rate meeting {sweep.criterion} (stable runs only): {sweep.max_rate}")
    if sweep.capacity:
        lines.append(f"capacity (load 1.0): {sweep.capacity:.3f} req/s")
    return "\n".join(lines)


def _finish_sweep(sweep: SweepResult, a: argparse.Namespace, slo: SLOSpec | None) -> None:
    print(_sweep_table(sweep))
    if a.out is not None:
        save_result(sweep, a.out)
        print(f"wrote {a.out}")
    if a.plot_dir is not None:
        from bench.plots import plot_all

        line = slo.normalized_latency if slo else None
        if line is None and sweep.criterion and sweep.criterion.startswith("normalized_latency"):
            line = float(sweep.criterion.split("<=")[-1])
        for path in plot_all([sweep], a.plot_dir, slo=line):
            print(f"wrote {path}")
