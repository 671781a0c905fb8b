"""Swap-in delays and serving figures of live runs, from their plan traces.

A swap-in's delay is the time from the plan that asked for it to the plan
that found it landed (both in the run's trace, `python -m bench
trace-live`); while it is in flight the job holds its device blocks and
does not run.

    python -m studies.kv_tier.table --out studies/kv_tier/ab_2.0.json \\
        studies/kv_tier/runs/*_[12].json
    python -m studies.kv_tier.table --traces-only --out studies/kv_tier/earlier_runs.json \\
        studies/econoserve_live/natural_replay/runs/*_natural_*.json

Each RUN.json is read with RUN.trace.json.gz beside it (and RUN.stats.json,
the engine replica's stats at the run's end, where there is one).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path
from typing import Any

from studies.econoserve_live.natural_table import row


def swap_in_delays(trace: list[dict[str, Any]]) -> list[float]:
    asked: dict[str, float] = {}
    delays = []
    for plan in trace:
        for job in plan["swap_in"]:
            asked[job] = plan["t"]
        for job in plan["landed"]:
            if job in asked:
                delays.append(plan["t"] - asked.pop(job))
    return sorted(delays)


def trace_figures(trace: list[dict[str, Any]]) -> dict[str, Any]:
    d = swap_in_delays(trace)
    q = max(1, len(trace) // 4)
    return {
        "plans": len(trace),
        "mean_batch": statistics.mean(len(p["jobs"]) for p in trace),
        "first_quarter_batch": statistics.mean(len(p["jobs"]) for p in trace[:q]),
        "swap_ins": len(d),
        "swap_in_delay_median_s": statistics.median(d) if d else None,
        "swap_in_delay_p90_s": d[int(0.9 * len(d))] if d else None,
        "swap_in_delay_max_s": d[-1] if d else None,
        "swap_ins_over_1s": sum(x > 1 for x in d),
        "swap_in_delay_total_s": sum(d),
    }


def figures(path: Path, traces_only: bool) -> dict[str, Any]:
    run = json.loads(path.read_text())
    stem = str(path).removesuffix(".json")
    trace = json.load(gzip.open(stem + ".trace.json.gz"))["trace"]
    out: dict[str, Any] = {"run": stem}
    if not traces_only:
        out |= row(run, run["meta"]["details"]["client"]["max_tokens"])
    out |= trace_figures(trace)
    stats_path = Path(stem + ".stats.json")
    if stats_path.exists():
        engines = json.loads(stats_path.read_text())  # one replica in these runs
        out["tier"] = engines[0]["swap"].get("tier") if engines else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--traces-only", action="store_true",
                    help="only what the traces give (runs made before the client was recorded)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = [figures(p, args.traces_only) for p in args.runs]
    args.out.write_text(json.dumps(rows, indent=1))
    for r in rows:
        d = (f"swap-ins {r['swap_ins']}, delay median / P90 / max "
             f"{r['swap_in_delay_median_s'] or 0:.3f} / {r['swap_in_delay_p90_s'] or 0:.3f} / "
             f"{r['swap_in_delay_max_s'] or 0:.3f} s, over 1 s {r['swap_ins_over_1s']}, "
             f"batch {r['mean_batch']:.2f} (first quarter {r['first_quarter_batch']:.2f})")
        serving = ("" if args.traces_only else
                   f"; mean NL {r['mean_nl_ms']:.1f} ms, P99 TTFT {r['p99_ttft_s']:.2f} s, "
                   f"TPOT {r['mean_tpot_ms']:.1f} ms, {r['throughput_req_s']:.3f} req/s")
        print(f"{Path(r['run']).name}: {d}{serving}")


if __name__ == "__main__":
    main()
