"""Where a run's decode time goes, by answer length: each request's TPOT
(time from its first token to its last over the tokens after the first),
its mean per length band, and how much of all decode time was spent in
stalls (a gap between two tokens of one answer longer than STALL seconds:
the answer waited out of the batch, swapped or skipped).

    python -m studies.econoserve_live.tpot_by_length --out OUT.json RUN.json...
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

BANDS = ((2, 64), (64, 192), (192, 100_000))
STALL = 0.1


def breakdown(run: dict[str, Any]) -> dict[str, Any]:
    recs = [r for r in run["records"] if r.get("error") is None and len(r["token_times"]) > 1]
    tpot = {id(r): (r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1)
            for r in recs}
    gaps = [b - a for r in recs for a, b in zip(r["token_times"], r["token_times"][1:])]
    stalls = [g for g in gaps if g > STALL]
    bands = {}
    for lo, hi in BANDS:
        sel = [tpot[id(r)] for r in recs if lo <= len(r["token_times"]) < hi]
        bands[f"{lo}-{hi - 1}"] = {"requests": len(sel),
                                   "mean_tpot_ms": 1e3 * statistics.mean(sel) if sel else None}
    return {"system": run["meta"]["system"], "requests": len(recs),
            "mean_tpot_ms": 1e3 * statistics.mean(tpot.values()),
            "median_tpot_ms": 1e3 * statistics.median(tpot.values()),
            "decode_s": sum(gaps), "stalls": len(stalls), "stalled_s": sum(stalls),
            "by_length": bands}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = [breakdown(json.loads(p.read_text())) for p in args.runs]
    args.out.write_text(json.dumps(rows, indent=1))
    names = list(rows[0]["by_length"])
    print("| system | mean / median TPOT (ms) | " + " | ".join(
        f"TPOT, answers of {n} tokens (ms)" for n in names) + " | stalled / all decode (s) |")
    print("| --- " * (3 + len(names)) + "|")
    for r in rows:
        cells = " | ".join("–" if b["mean_tpot_ms"] is None else
                           f"{b['mean_tpot_ms']:.1f} ({b['requests']})"
                           for b in r["by_length"].values())
        print(f"| {r['system']} | {r['mean_tpot_ms']:.1f} / {r['median_tpot_ms']:.1f} | {cells} | "
              f"{r['stalled_s']:.0f} / {r['decode_s']:.0f} |")


if __name__ == "__main__":
    main()
