"""What became of the requests of a replica-kill run (replica_kill.sh):
lost requests, resumed ones and the tokens recomputed for them, and
TTFT / TPOT percentiles before the kill, around it and after.

    python -m studies.survival.report studies/survival/runs
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.metrics import tpot
from bench.records import RequestRecord
from bench.results import RunResult, load_result

RECOVERY_S = 60.0


def pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 3) if xs else None


def window(records: list[RequestRecord], lo: float, hi: float) -> dict[str, Any]:
    """Requests sent in [lo, hi) seconds after the run's start."""
    rs = [r for r in records if lo <= r.send_time < hi and r.error is None and not r.rejected]
    ttfts = [r.ttft for r in rs if r.ttft is not None]
    tpots = [x for x in map(tpot, rs) if x is not None]
    return {"requests": len(rs), "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
            "tpot_p50_s": pct(tpots, 50), "tpot_p99_s": pct(tpots, 99)}


def main() -> None:
    out = Path(sys.argv[1])
    run = load_result(out / "run.json")
    assert isinstance(run, RunResult) and run.records is not None
    records = run.records
    kill = json.loads((out / "kill.json").read_text())
    after = json.loads((out / "after.json").read_text())
    # Send times count from the run's start, which is its end (`created`,
    # to the second) less its wall time.
    start = datetime.fromisoformat(run.meta.created).timestamp() \
        - float(run.meta.details["wall_time"])
    killed_at = kill["time"] - start
    failed = [r for r in records if r.error is not None]
    engines = after["engine_stats"]
    choices = sum((e.get("resumed") or {}).get("jobs", 0) for e in engines)
    recomputed = sum((e.get("resumed") or {}).get("tokens_recomputed", 0) for e in engines)
    fetched = sum((e.get("resumed") or {}).get("tokens_fetched", 0) for e in engines)
    report = {
        "requests": len(records),
        "completed": sum(1 for r in records if r.error is None and not r.rejected),
        "rejected": sum(1 for r in records if r.rejected),
        "failed": len(failed),
        "failure_kinds": sorted({(r.error or "")[:80] for r in failed}),
        "killed": kill["killed"], "killed_at_s": round(killed_at, 1),
        "resumed_requests": after["resumed"], "resumed_choices": choices,
        "tokens_recomputed_per_resumed_choice":
            round(recomputed / choices, 1) if choices else None,
        # Their KV fetched from the failed replica's checkpoints instead.
        "tokens_fetched_per_resumed_choice":
            round(fetched / choices, 1) if choices else None,
        "before_kill": window(records, 0.0, killed_at - 30.0),
        "around_kill": window(records, killed_at - 30.0, killed_at + RECOVERY_S),
        "after": window(records, killed_at + RECOVERY_S, float("inf")),
        "request_throughput": run.summary.request_throughput,
    }
    print(json.dumps(report, indent=1))
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
