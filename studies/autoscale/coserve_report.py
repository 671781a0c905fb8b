"""Fixed against autoscaled while co-serving (studies/autoscale/coserve.sh).

    python -m studies.autoscale.coserve_report wait-offline REPLICAS.jsonl
        until the replica log shows the first offline tokens, then 5 s more
    python -m studies.autoscale.coserve_report report FOLDER
        per system: report.py's online figures and replica-seconds over the
        online stream, offline tokens/s over it and over the tail after it,
        and when the replicas came and went
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.results import load_result
from studies.autoscale.report import one, window
from studies.conserve_live.batch import wait_for_offline


def _log(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut short by the poller's end
            pass
    return out


def wait_offline(path: Path) -> None:
    wait_for_offline(lambda: _log(path) if path.exists() else [], str(path))


def _offline_rate(log: list[dict[str, Any]], t0: float, t1: float) -> float:
    """Offline tokens/s over [t0, t1]: the sum of the counters' rises
    between lines (a replica let go takes its count with it: a fall is
    not counted as negative work)."""
    pts = [(x["time"], x["tokens_by_class"].get("offline", 0)) for x in log
           if "tokens_by_class" in x and t0 <= x["time"] <= t1]
    rise = sum(max(0, b - a) for (_, a), (_, b) in zip(pts, pts[1:]))
    return rise / (pts[-1][0] - pts[0][0]) if len(pts) > 1 else 0.0


def _system(out: Path, system: str) -> dict[str, Any]:
    row = one(out, system)
    t0, t1 = window(load_result(out / f"{system}.json"))
    log = _log(out / f"{system}.replicas.jsonl")
    row["offline_tokens_per_s_online_span"] = round(_offline_rate(log, t0, t1), 1)
    row["offline_tokens_per_s_tail"] = round(_offline_rate(log, t1, log[-1]["time"]), 1)
    row["tail_s"] = round(log[-1]["time"] - t1, 1)
    # Changes of the running count, seconds from the online stream's start.
    changes, last = [], None
    for x in log:
        if x["running"] >= 0 and x["running"] != last:
            changes.append([round(x["time"] - t0, 1), x["running"]])
            last = x["running"]
    row["replicas_over_time"] = changes
    return row


def report(out: Path) -> None:
    rep = {s: _system(out, s) for s in ("fixed", "autoscaled")
           if (out / f"{s}.json").exists()}
    print(json.dumps(rep, indent=1))
    (out / "report.json").write_text(json.dumps(rep, indent=1) + "\n")


def main(argv: list[str]) -> None:
    cmd, path = argv[0], Path(argv[1])
    if cmd == "wait-offline":
        wait_offline(path)
    elif cmd == "report":
        report(path)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
