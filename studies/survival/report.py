"""What became of the requests of a replica-kill run (replica_kill.sh):
lost requests, resumed ones and the tokens recomputed for them, TTFT /
TPOT percentiles before the kill, around it and after, and how far the
replicas' checkpoints lagged behind their jobs through the run
(`exposure.jsonl`, studies/survival/watch.py).

    python -m studies.survival.report studies/survival/runs [--host-blocks N]
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


def exposure(rows: list[dict[str, Any]], host_blocks: int | None = None) -> dict[str, Any]:
    """Over every sample of every replica with resident jobs: the tokens
    per resident job past its last checkpoint (what a death at that moment
    would make another replica recompute, per job), the largest one job had,
    and the blocks queued for the host tier but not stored yet.  With the
    replicas' host tier size (`host_blocks`), the same split by whether the
    tier was at least 90 % full."""
    busy = [r for r in rows if r.get("resident_jobs")]
    if not busy:
        return {"samples": 0}
    per_job = [r["uncovered_tokens"] / r["resident_jobs"] for r in busy]
    pending = [r["tier_pending_blocks"] for r in busy]
    split: dict[str, Any] = {}
    if host_blocks:
        full = [r["host_used_blocks"] >= 0.9 * host_blocks for r in busy]
        split = {"host_full_share": round(sum(full) / len(busy), 3)}
        for name, want in (("host_full", True), ("host_not_full", False)):
            xs = [x for x, f in zip(per_job, full) if f is want]
            split[f"uncovered_tokens_per_job_mean_{name}"] = (
                round(float(np.mean(xs)), 1) if xs else None)
    return {**split, "samples": len(busy),
            "resident_jobs_mean": round(float(np.mean([r["resident_jobs"] for r in busy])), 1),
            "kv_use_mean": round(float(np.mean([r["kv_use"] for r in busy])), 3),
            "kv_use_p95": pct([r["kv_use"] for r in busy], 95),
            "host_used_blocks_max": max(r.get("host_used_blocks", 0) for r in busy),
            "uncovered_tokens_per_job_mean": round(float(np.mean(per_job)), 1),
            "uncovered_tokens_per_job_p95": pct(per_job, 95),
            "max_uncovered_tokens_p95": pct([r["max_uncovered_tokens"] for r in busy], 95),
            "tier_pending_blocks_mean": round(float(np.mean(pending)), 2),
            "tier_pending_blocks_max": max(pending)}


def main() -> None:
    out = Path(sys.argv[1])
    # --host-blocks N: each replica's host tier, in blocks (host_kv_tokens / block_size).
    host_blocks = (int(sys.argv[sys.argv.index("--host-blocks") + 1])
                   if "--host-blocks" in sys.argv else None)
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
    watched = out / "exposure.jsonl"
    if watched.exists():
        rows = [json.loads(line) for line in watched.read_text().splitlines() if line.strip()]
        report["exposure"] = exposure(rows, host_blocks)
        report["exposure_at_kill"] = kill.get("exposure")
    print(json.dumps(report, indent=1))
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
