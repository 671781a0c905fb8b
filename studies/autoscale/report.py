"""Fixed against autoscaled on the same bursty run (bursty.sh): online SLO
attainment (TTFT within 2 s), TTFT and TPOT percentiles, and
replica-seconds over the run (from the once-a-second replica log).

    python -m studies.autoscale.report studies/autoscale/runs
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.metrics import tpot
from bench.results import RunResult, load_result

SLO_TTFT_S = 2.0


def window(run: RunResult) -> tuple[float, float]:
    """Wall-clock times of the run's first send and last end.  Record
    times count from the run's start: its end (`created`, to the second)
    less its wall time; the replica log has wall-clock times."""
    assert run.records is not None
    start = datetime.fromisoformat(run.meta.created).timestamp() \
        - float(run.meta.details["wall_time"])
    return (start + min(r.send_time for r in run.records),
            start + max(r.end_time or r.send_time for r in run.records))


def one(out: Path, system: str) -> dict[str, Any]:
    run = load_result(out / f"{system}.json")
    assert isinstance(run, RunResult) and run.records is not None
    rs = run.records
    t0, t1 = window(run)
    done = [r for r in rs if r.error is None and not r.rejected]
    ttft = [r.ttft for r in done if r.ttft is not None]
    tpots = [t for t in (tpot(r) for r in done) if t is not None]
    log = [json.loads(x) for x in (out / f"{system}.replicas.jsonl").read_text().splitlines()]
    during = [x for x in log if t0 <= x["time"] <= t1 and x["running"] >= 0]
    # Once a second: replica-seconds is the sum of the counts.
    replica_s = sum(x["running"] for x in during) * (t1 - t0) / max(1, len(during))
    return {
        "requests": len(rs), "completed": len(done),
        "failed": sum(1 for r in rs if r.error is not None),
        "ttft_within_slo": round(sum(1 for x in ttft if x <= SLO_TTFT_S) / max(1, len(rs)), 3),
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
        "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3),
        "tpot_p50_s": round(float(np.percentile(tpots, 50)), 4),
        "tpot_p99_s": round(float(np.percentile(tpots, 99)), 4),
        "duration_s": round(t1 - t0, 1), "replica_seconds": round(replica_s, 1),
        "max_replicas_seen": max((x["running"] for x in during), default=0),
    }


def main() -> None:
    out = Path(sys.argv[1])
    report = {s: one(out, s) for s in ("fixed", "autoscaled")}
    print(json.dumps(report, indent=1))
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
