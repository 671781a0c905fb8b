"""`head.sh`'s runs (answers that end by themselves) as one table: the
serving figures of each run and how close each request's length estimate
came to its answer.

    python -m studies.econoserve_live.natural_table --cap 256 \\
        --out studies/econoserve_live/natural_1.4.json \\
        studies/econoserve_live/runs/{fcfs,mlfq,econoserve,econoserve-head}_natural_1.4.json

"Finished while arriving": the share of the requests done by the last
one's arrival (a run that keeps up finishes nearly all; below 95 % its
queue grew).  Estimates are capped at the run's `max_tokens` (CAP), as the
allocation is; "under" is the share whose answer outgrew its estimate
+ 15 % (EconoServe's padding).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def estimates(recs: list[dict[str, Any]], cap: int) -> dict[str, Any]:
    """How close the length estimates of the answered requests `recs` came
    to their answers, each estimate capped at `cap` (`head.sh`'s summary)."""
    pairs = [(min(r["predicted_output_tokens"], cap), r["output_tokens"]) for r in recs
             if r.get("predicted_output_tokens") is not None]
    err = [abs(p - o) for p, o in pairs]
    n = max(1, len(pairs))
    return {"with_estimate": len(pairs), "mae": sum(err) / n,
            "acc50": sum(e <= 50 for e in err) / n, "acc100": sum(e <= 100 for e in err) / n,
            "under": sum(p * 1.15 < o for p, o in pairs) / n}


def row(run: dict[str, Any], cap: int) -> dict[str, Any]:
    s, recs = run["summary"], [r for r in run["records"] if r.get("error") is None]
    last_arrival = max(r["scheduled_time"] for r in run["records"])
    est = estimates(recs, cap)
    return {
        "system": run["meta"]["system"], "completed": s["num_completed"],
        "finished_while_arriving": sum(r["end_time"] <= last_arrival for r in recs)
        / len(run["records"]),
        "throughput_req_s": s["request_throughput"],
        "output_tokens": sum(r["output_tokens"] for r in recs),
        "capped": sum(r["output_tokens"] >= cap for r in recs),
        "mean_nl_ms": 1e3 * s["normalized_latency"]["mean"],
        "p95_nl_ms": 1e3 * s["normalized_latency"]["p95"],
        "mean_e2e_s": s["e2e"]["mean"], "p99_e2e_s": s["e2e"]["p99"],
        "p99_ttft_s": s["ttft"]["p99"], "mean_tpot_ms": 1e3 * s["tpot"]["mean"],
        "preemptions": s["num_preemptions"],
        # A simulated run's iterations: requests per batch, the KV cache's share
        # in use, and computed tokens dropped by preemptions (recomputed later).
        **{k: run["meta"].get("details", {}).get("sim", {}).get(v) for k, v in (
            ("mean_batch", "mean_batch_size"), ("kv_used", "mean_kv_utilization"),
            ("tokens_recomputed", "tokens_dropped"))},
        # None where no request had an estimate (FCFS, MLFQ replayed without).
        "estimate_mae": est["mae"] if est["with_estimate"] else None,
        "estimate_under": est["under"] if est["with_estimate"] else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--cap", type=int, required=True, help="the runs' max_tokens")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = [row(json.loads(p.read_text()), args.cap) for p in args.runs]
    args.out.write_text(json.dumps(rows, indent=1))
    print("| system | finished while arriving | throughput (req/s) | output tokens | mean / P95 NL "
          "(ms/token) | mean / P99 E2E (s) | P99 TTFT (s) | mean TPOT (ms) | preemptions | "
          "estimate MAE | under |")
    print("| --- " * 11 + "|")
    for r in rows:
        print(f"| {r['system']} | {100 * r['finished_while_arriving']:.1f} % | "
              f"{r['throughput_req_s']:.3f} | {r['output_tokens']} | {r['mean_nl_ms']:.1f} / "
              f"{r['p95_nl_ms']:.1f} | {r['mean_e2e_s']:.2f} / {r['p99_e2e_s']:.2f} | "
              f"{r['p99_ttft_s']:.2f} | {r['mean_tpot_ms']:.1f} | {r['preemptions']} | "
              + ("– | – |" if r["estimate_mae"] is None else
                 f"{r['estimate_mae']:.1f} | {100 * r['estimate_under']:.0f} % |"))


if __name__ == "__main__":
    main()
