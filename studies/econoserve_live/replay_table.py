"""`natural_replay.sh`'s common-cost replays summed up per policy: over
every run's answers and every cost table given, the mean and range of each
figure, and on how many (answers, table) pairs each policy had the lowest
mean normalized latency.

    python -m studies.econoserve_live.replay_table \\
        --out studies/econoserve_live/natural_replay/by_policy_2.0.json \\
        studies/econoserve_live/natural_replay/natural_replay_2.0_on_*.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

FIGURES = ("finished_while_arriving", "throughput_req_s", "mean_nl_ms", "p95_nl_ms",
           "p99_ttft_s", "mean_tpot_ms", "preemptions", "mean_batch", "kv_used",
           "tokens_recomputed")


def by_policy(tables: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Rows named POLICY@RUN (one table per cost table) grouped by policy."""
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    best: dict[str, int] = defaultdict(int)
    for table in tables:
        sets: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in table:
            policy, _, answers = r["system"].partition("@")
            rows[policy].append(r)
            sets[answers].append(r)
        for group in sets.values():
            best[min(group, key=lambda r: r["mean_nl_ms"])["system"].partition("@")[0]] += 1
    return {policy: {"replays": len(rs), "lowest_mean_nl": best[policy],
                     **{f: {"mean": sum(r[f] for r in rs) / len(rs),
                            "min": min(r[f] for r in rs), "max": max(r[f] for r in rs)}
                        for f in FIGURES}}
            for policy, rs in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tables", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    summary = by_policy([json.loads(p.read_text()) for p in args.tables])
    args.out.write_text(json.dumps(summary, indent=1))
    print("| policy | replays | lowest mean NL | finished while arriving | throughput (req/s) | "
          "mean NL (ms/token) | P99 TTFT (s) | mean TPOT (ms) | preemptions | mean batch | "
          "KV used | tokens recomputed |")
    print("| --- " * 12 + "|")
    for policy, s in summary.items():
        def cell(f: str, scale: float = 1.0, fmt: str = ".1f") -> str:
            v = s[f]
            return (f"{scale * v['mean']:{fmt}} ({scale * v['min']:{fmt}}–"
                    f"{scale * v['max']:{fmt}})")
        print(f"| {policy} | {s['replays']} | {s['lowest_mean_nl']} | "
              f"{cell('finished_while_arriving', 100)} % | "
              f"{cell('throughput_req_s', fmt='.2f')} | {cell('mean_nl_ms')} | "
              f"{cell('p99_ttft_s', fmt='.2f')} | {cell('mean_tpot_ms')} | "
              f"{cell('preemptions', fmt='.0f')} | {cell('mean_batch', fmt='.2f')} | "
              f"{cell('kv_used', 100, '.0f')} % | {cell('tokens_recomputed', fmt='.0f')} |")


if __name__ == "__main__":
    main()
