"""The instrumented run's tier operations (`probe_4d15f3f.patch`: every store, fetch and drop
of the one-thread tier of commit 4d15f3f logged as [op, job, blocks, submitted, started, ended]):
how long each waited in the thread's queue and ran, and for each fetch that waited, whether a
store of its own job or only other jobs' stores were ahead of it.

    python -m studies.kv_tier.probe_table studies/kv_tier/probe_4d15f3f_fcfs_2.0.jsonl.gz \\
        --out studies/kv_tier/probe_4d15f3f_fcfs_2.0.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path


def spread(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"n": len(xs), "median": statistics.median(xs), "p90": xs[int(0.9 * len(xs))],
            "max": xs[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = [json.loads(line) for line in gzip.open(args.log, "rt")]
    t0 = min(r[3] for r in rows)
    puts = [r for r in rows if r[0] == "put"]
    out: dict = {}
    for op in ("put", "get", "drop"):
        ops = [r for r in rows if r[0] == op]
        out[op] = {"queued_s": spread([r[4] - r[3] for r in ops]),
                   "ran_s": spread([r[5] - r[4] for r in ops])}
    out["slow_puts"] = [{"at_s": r[4] - t0, "blocks": r[2], "ran_s": r[5] - r[4]}
                        for r in puts if r[5] - r[4] > 1]
    behind_own = behind_others = 0
    wait_own = wait_others = 0.0
    for g in (r for r in rows if r[0] == "get"):
        own = any(p[1] == g[1] and p[3] <= g[3] < p[5] for p in puts)
        if own:
            behind_own += 1
            wait_own += g[4] - g[3]
        else:
            behind_others += 1
            wait_others += g[4] - g[3]
    out["gets_with_own_store_pending"] = {"n": behind_own, "queued_s_total": wait_own}
    out["gets_behind_other_jobs_only"] = {"n": behind_others, "queued_s_total": wait_others}
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
