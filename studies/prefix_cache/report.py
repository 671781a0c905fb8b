"""Prefix caching on against off on the same workload (run.sh): completed
and refused (429, admission control) requests, output tokens/s, TTFT and
TPOT percentiles of the completed ones per run, and the tokens each engine
found in its prefix cache.

    python -m studies.prefix_cache.report studies/prefix_cache/runs_rate1.0
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.results import RunResult, load_result


def one(run_path: Path) -> dict[str, Any]:
    run = load_result(run_path)
    assert isinstance(run, RunResult)
    s = run.summary
    out: dict[str, Any] = {
        "requests": s.num_requests, "completed": s.num_completed, "failed": s.num_failed,
        "refused_429": s.num_rejected,
        "duration_s": round(s.duration, 1),
        "request_rate_done": round(s.request_throughput, 3),
        "output_tokens_per_s": round(s.output_token_throughput, 1),
        "ttft_p50_s": round(s.ttft.median, 3), "ttft_p99_s": round(s.ttft.p99, 3),
        "tpot_p50_s": round(s.tpot.median, 4), "tpot_p99_s": round(s.tpot.p99, 4),
    }
    engines = run_path.with_suffix(".engine.json")
    if engines.exists():
        stats = json.loads(engines.read_text())
        hit = sum(e.get("prefix_cache", {}).get("hit_tokens", 0) for e in stats)
        asked = sum(e.get("prefix_cache", {}).get("queried_tokens", 0) for e in stats)
        out["prefix_hit_tokens"] = hit
        out["prefix_hit_share"] = round(hit / asked, 3) if asked else None
    return out


def main() -> None:
    folder = Path(sys.argv[1])
    report = {p.stem: one(p) for p in sorted(folder.glob("*.json"))
              if not p.name.endswith((".engine.json", "report.json"))}
    print(json.dumps(report, indent=1))
    (folder / "report.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
