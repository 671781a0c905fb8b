"""The figures of studies/autoscale/overload.sh's runs: report.py's online
figures per system, and the engine's preemptions and swaps.

    python -m studies.autoscale.overload studies/autoscale/overload_1128
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.metrics import tpot
from bench.results import load_result
from studies.autoscale.report import SLO_TTFT_S

SYSTEMS = ("mlfq", "conserve_recompute", "conserve_proactive")


def one(out: Path, system: str) -> dict[str, Any]:
    rs = load_result(out / f"{system}.json").records
    done = [r for r in rs if r.error is None and not r.rejected]
    ttft = [r.ttft for r in done if r.ttft is not None]
    tpots = [t for t in (tpot(r) for r in done) if t is not None]
    engine = json.loads((out / f"{system}.engine.json").read_text())[0]
    swap = engine.get("swap") or {}
    return {
        "requests": len(rs), "completed": len(done),
        "ttft_within_slo": round(sum(1 for x in ttft if x <= SLO_TTFT_S) / max(1, len(rs)), 3),
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
        "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3),
        "tpot_p50_s": round(float(np.percentile(tpots, 50)), 4),
        "tpot_p99_s": round(float(np.percentile(tpots, 99)), 4),
        "duration_s": round(max(r.end_time or r.send_time for r in rs)
                            - min(r.send_time for r in rs), 1),
        "preemptions": engine.get("num_preemptions"),
        "swap_outs": swap.get("swap_outs"),
    }


def main() -> None:
    out = Path(sys.argv[1])
    report = {s: one(out, s) for s in SYSTEMS if (out / f"{s}.json").exists()}
    print(json.dumps(report, indent=1))
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
