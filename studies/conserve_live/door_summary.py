"""Co-served runs with and without the Ingress's door, side by side.

    python -m studies.conserve_live.door_summary studies/conserve_live/door_1128

Reads `online-only.json` and every `conserve-*.json` in the folder (written
by run.sh's `bench run`, renamed per run); writes `summary.md`: online TTFT
over all requests, over those sent in the first 10 s (beside the offline
backlog's burst of HTTP requests) and after, TPOT, and offline tokens/s while
the online stream lasted.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.metrics import summarize, tokens_per_s_while
from bench.results import load_result
from studies.conserve_live.summary import AFTER_BURST_S


def main(folder: Path) -> None:
    base = load_result(folder / "online-only.json")
    span = max(r.send_time for r in base.records)
    lines = ["| run | online TTFT P50 / P99 (s) | P99 sent in the first 10 s | P99 sent after |"
             " TPOT P50 / P99 (s) | offline tokens/s |",
             "| --- | --- | --- | --- | --- | --- |"]
    runs = [("online-only", base)] + [(p.stem, load_result(p))
                                      for p in sorted(folder.glob("conserve-*.json"))
                                      if not p.stem.endswith(".engine")]
    for name, run in runs:
        online = [r for r in run.records if r.job_class == "online"]
        s = summarize(online)
        first = summarize([r for r in online if r.send_time <= AFTER_BURST_S])
        later = summarize([r for r in online if r.send_time > AFTER_BURST_S])
        off = "—"
        if any(r.job_class == "offline" for r in run.records):
            off = f"{tokens_per_s_while(run.records, 'offline', span)[0]:.1f}"
        lines.append(f"| {name} | {s.ttft.median:.3f} / {s.ttft.p99:.3f} | {first.ttft.p99:.3f} "
                     f"| {later.ttft.p99:.3f} | {s.tpot.median:.3f} / {s.tpot.p99:.3f} | {off} |")
    (folder / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
