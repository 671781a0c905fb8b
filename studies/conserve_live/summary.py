"""The live co-serving runs side by side (studies/conserve_live/run.sh).

    python -m studies.conserve_live.summary studies/conserve_live

Online P50/P99 TTFT and TPOT against online-only; offline tokens/s while the
online stream lasted (the online-only run's last send) against vllm++ and
offline-only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.metrics import summarize, tokens_per_s_while
from bench.results import load_result

COSERVED = ["vllm++", "conserve", "conserve-startup", "conserve-tpot300"]
SYSTEMS = ["online-only", "offline-only", *COSERVED]
# run.sh's sweep of the TPOT objective: conserve-tpot{seconds}.
SWEEP = "conserve-tpot0."
# The backlog's requests all arrive at t = 0: the ingress takes seconds to
# pass 40 of them on, and online requests sent meanwhile queue behind them.
# TTFT is also given for the online requests sent after this.
AFTER_BURST_S = 10.0


def add_ratios(row: dict[str, Any], rows: dict[str, dict[str, Any]]) -> None:
    """A co-served run's figures against online-only's latency and vllm++'s
    and offline-only's throughput (`rows`: the runs by name)."""
    base, ref = rows["online-only"], rows["vllm++"]
    row["ttft_p99_vs_online_only"] = row["ttft_p99"] / base["ttft_p99"]
    row["ttft_p99_after_burst_vs_online_only"] = (row["ttft_p99_after_burst"]
                                                  / base["ttft_p99_after_burst"])
    row["tpot_p99_vs_online_only"] = row["tpot_p99"] / base["tpot_p99"]
    row["offline_vs_vllmpp"] = row["offline_tokens_per_s"] / ref["offline_tokens_per_s"]
    row["offline_vs_offline_only"] = (row["offline_tokens_per_s"]
                                      / rows["offline-only"]["offline_tokens_per_s"])


def main(folder: Path) -> None:
    swept = sorted((p.stem for p in folder.glob(f"{SWEEP}*.json")
                    if not p.stem.endswith(".engine")), key=lambda s: float(s[len(SWEEP) - 2:]))
    names = [*SYSTEMS, *swept]
    runs = {s: load_result(folder / f"{s}.json") for s in names if (folder / f"{s}.json").exists()}
    span = max(r.send_time for r in runs["online-only"].records)
    rows: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        row: dict[str, Any] = {}
        online = [r for r in run.records if r.job_class == "online"]
        if online:
            s = summarize(online)
            later = summarize([r for r in online if r.send_time > AFTER_BURST_S])
            row.update(completed=s.num_completed, ttft_p50=s.ttft.median, ttft_p99=s.ttft.p99,
                       tpot_p50=s.tpot.median, tpot_p99=s.tpot.p99,
                       ttft_p99_after_burst=later.ttft.p99)
        if any(r.job_class == "offline" for r in run.records):
            rate, window = tokens_per_s_while(run.records, "offline", span)
            row.update(offline_tokens_per_s=rate, offline_window_s=window)
        rows[name] = row
    coserved = [n for n in [*COSERVED, *swept] if n in rows]
    for name in coserved:
        add_ratios(rows[name], rows)
    (folder / "summary.json").write_text(json.dumps({"span_s": span, "systems": rows}, indent=1))
    lines = ["| system | online P50 / P99 TTFT (s) | P99 TTFT sent after 10 s | "
             "online P50 / P99 TPOT (s) | offline tokens/s |",
             "| --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        on = (f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | {r['ttft_p99_after_burst']:.2f} | "
              f"{r['tpot_p50']:.3f} / {r['tpot_p99']:.3f}" if "ttft_p99" in r else "— | — | —")
        off = f"{r['offline_tokens_per_s']:.1f}" if "offline_tokens_per_s" in r else "—"
        lines.append(f"| {name} | {on} | {off} |")
    (folder / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({k: {m: v for m, v in r.items() if "vs" in m} for k, r in rows.items()
                      if k in coserved}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
