"""Inter-token latency by how many requests were decoding at the time, for
runs saved with their records (`BENCH_EXTRA=--save-records bash triple.sh
...`): where in a run one server's steps are slower than the other's.

Every gap between two tokens of a request is put in the bucket of the number
of requests that were between their first and last token at the gap's end
(a decode step's batch, seen from the client); each bucket's median gap is
about one decode step at that batch.

    python studies/engine_cpu/vllm_cpu/itl_by_running.py RUN.json [RUN.json ...]
"""

from __future__ import annotations

import bisect
import json
import statistics
import sys

BUCKETS = [(1, 10), (11, 30), (31, 60), (61, 100)]


def gaps_by_running(path: str) -> dict[str, tuple[int, float, float]]:
    records = json.load(open(path))["records"]
    if not records:
        raise SystemExit(f"{path} has no records: run with BENCH_EXTRA=--save-records")
    spans = [(r["token_times"][0], r["token_times"][-1]) for r in records if r["token_times"]]
    starts = sorted(s for s, _ in spans)
    ends = sorted(e for _, e in spans)
    out: dict[str, list[float]] = {f"{lo}-{hi}": [] for lo, hi in BUCKETS}
    for r in records:
        times = r["token_times"]
        for a, b in zip(times, times[1:]):
            running = bisect.bisect_right(starts, b) - bisect.bisect_left(ends, b)
            for lo, hi in BUCKETS:
                if lo <= running <= hi:
                    out[f"{lo}-{hi}"].append(b - a)
    return {k: (len(v), statistics.median(v) * 1e3 if v else float("nan"),
                sum(v) / len(v) * 1e3 if v else float("nan")) for k, v in out.items()}


def main() -> None:
    rows = {p: gaps_by_running(p) for p in sys.argv[1:]}
    print("running  " + "  ".join(f"{p.split('/')[-1][:34]:>34}" for p in rows))
    for lo, hi in BUCKETS:
        k = f"{lo}-{hi}"
        cells = [f"{n:6d} gaps, median {med:6.1f} ms" for n, med, _ in (rows[p][k] for p in rows)]
        print(f"{k:>7}  " + "  ".join(f"{c:>34}" for c in cells))


if __name__ == "__main__":
    main()
