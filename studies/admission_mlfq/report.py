"""The table of `run.sh`'s runs (runs/RUN_{bursts,overload}.json.gz; RUN: old,
backlog10, backlog3, remaining, backlog10r, as studies/admission_mlfq/README.md says).

    python -m studies.admission_mlfq.report [--ttft 2] [--tpot 0.2]

Every figure from the requests' records. "Within objectives": served whole
with the first token within `--ttft` s of being sent and the mean time per
later token within `--tpot`, over the requests offered (a 429 counts
against it). "Kept up": completions while requests arrive, past the first
fifth of the arrivals, over the arrivals of that window. Writes results.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from statistics import mean
from typing import Any

from bench.records import RequestRecord
from studies.latency_vs_vllm.report import _pct, meets

HERE = Path(__file__).resolve().parent


def summarize(path: Path, ttft_slo: float, tpot_slo: float) -> dict[str, Any]:
    recs = [RequestRecord.model_validate(r)
            for r in json.loads(gzip.decompress(path.read_bytes()))["records"]]
    ok = [r for r in recs if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
            for r in ok if len(r.token_times) > 1]
    e2e = [r.e2e for r in ok if r.e2e is not None]

    start = min(r.scheduled_time for r in recs)
    last = max(r.scheduled_time for r in recs)
    lo = start + 0.2 * (last - start)
    done = sum(1 for r in ok if r.end_time is not None and lo <= r.end_time <= last)
    arrived = sum(1 for r in recs if lo <= r.scheduled_time <= last)
    return {
        "offered": len(recs), "completed": len(ok), "rejected": sum(r.rejected for r in recs),
        "failed": sum(r.error is not None and not r.rejected for r in recs),
        "kept_up": done / arrived if arrived else 0.0,
        "ttft_p50": _pct(ttft, 0.5), "ttft_p99": _pct(ttft, 0.99), "ttft_max": max(ttft),
        "over_ttft": sum(t > ttft_slo for t in ttft),
        "tpot_mean": mean(tpot), "tpot_p50": _pct(tpot, 0.5), "tpot_p99": _pct(tpot, 0.99),
        "e2e_mean": mean(e2e), "e2e_p99": _pct(e2e, 0.99),
        "attainment": sum(meets(r, ttft_slo, tpot_slo) for r in recs) / len(recs),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ttft", type=float, default=2.0)
    p.add_argument("--tpot", type=float, default=0.2)
    args = p.parse_args(argv)
    lines = ["| run | code | completed / offered (429) | kept up "
             "| admitted TTFT P50 / P99 / max (s) "
             f"| admitted over {args.ttft:g} s | TPOT mean / P50 / P99 (ms) | E2E mean / P99 (s) "
             f"| within TTFT {args.ttft:g} s + TPOT {args.tpot * 1e3:g} ms |",
             "|" + "---|" * 9]
    for phase in ("bursts", "overload"):
        for code in ("old", "backlog10", "backlog3", "remaining", "backlog10r"):
            path = HERE / "runs" / f"{code}_{phase}.json.gz"
            if not path.exists():
                continue
            s = summarize(path, args.ttft, args.tpot)
            lines.append(
                f"| {phase} | {code} | {s['completed']} / {s['offered']} ({s['rejected']}) "
                f"| {s['kept_up']:.0%} | {s['ttft_p50']:.2f} / {s['ttft_p99']:.2f} / "
                f"{s['ttft_max']:.2f} | {s['over_ttft']} | {s['tpot_mean'] * 1e3:.0f} / "
                f"{s['tpot_p50'] * 1e3:.0f} / {s['tpot_p99'] * 1e3:.0f} | {s['e2e_mean']:.1f} / "
                f"{s['e2e_p99']:.1f} | {s['attainment']:.1%} |")
    text = "\n".join(lines) + "\n"
    (HERE / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
