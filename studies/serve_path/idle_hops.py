"""Where an idle server's first token goes, hop by hop, through each HTTP entry of one server.

Sends distinct prompts of random token ids (`max_tokens` 1, greedy, not streamed) one at a
time, alternating between the entries (`--entries proxy=8000,direct=8100`: Serve's HTTP proxy,
and the ingress replica's own HTTP server under direct ingress), then reads the engine
replica's trace (`python -m bench trace-live`: each request's arrival and its plan, on the
host's monotonic clock, which the client shares) and splits each request's time into:
client to engine replica (HTTP, proxy, ingress, admission, the call to the engine), arrival
to plan, the iteration, and back (engine to ingress to client).

    python -m studies.serve_path.idle_hops --entries proxy=8000,direct=8100 \\
        --out studies/serve_path/direct_ingress/idle_hops.json   # direct_ingress.sh runs it
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

PARTS = ("to_engine", "arrival_to_plan", "iteration", "back", "total")


def send(port: int, ids: list[int]) -> tuple[float, float]:
    """(monotonic send time, answer time) of one completion."""
    body = {"model": "smollm2", "prompt": ids, "max_tokens": 1, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
    return t0, time.monotonic()


def parse_entries(text: str) -> dict[str, int]:
    """`NAME=PORT,…` -> {name: port}, in order."""
    return {name: int(port) for name, port in (e.split("=", 1) for e in text.split(","))}


def split(sent: list[tuple[str, int, float, float]], trace: dict[str, Any]
          ) -> dict[str, dict[str, dict[str, float]]]:
    """Median milliseconds of each part, by entry and prompt length; a
    request counts where exactly one arrival falls within its time."""
    arrivals = sorted((t, rid) for t, rid in trace["arrivals"])
    plan_of: dict[str, dict[str, Any]] = {}
    for p in trace["trace"]:
        for j in p["jobs"]:
            plan_of.setdefault(j, p)
    parts: dict[tuple[str, int], dict[str, list[float]]] = {}
    for entry, n, t0, t1 in sent:
        inside = [(t, rid) for t, rid in arrivals if t0 <= t <= t1]
        if len(inside) != 1 or inside[0][1] not in plan_of:
            continue
        (arrived, rid), = inside
        plan = plan_of[rid]
        done = plan["t"] + plan["iteration_time"]
        row = parts.setdefault((entry, n), {k: [] for k in PARTS})
        for k, v in zip(PARTS, (arrived - t0, plan["t"] - arrived, plan["iteration_time"],
                                t1 - done, t1 - t0)):
            row[k].append(1e3 * v)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (entry, n), row in sorted(parts.items()):
        out.setdefault(entry, {})[str(n)] = {
            **{k: round(statistics.median(v), 2) for k, v in row.items()},
            "total_min": round(min(row["total"]), 2), "requests": len(row["total"])}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.serve_path.idle_hops",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--entries", default="proxy=8000,direct=8100", help="NAME=PORT,…")
    ap.add_argument("--lens", default="16,128")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--gap-s", type=float, default=0.2, help="idle time between requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    entries = parse_entries(a.entries).items()
    rng = random.Random(a.seed)
    for _, port in entries:  # each entry's first request's one-off costs
        send(port, [rng.randrange(1000, 40000) for _ in range(8)])
    sent: list[tuple[str, int, float, float]] = []
    for n in (int(v) for v in a.lens.split(",")):
        for _ in range(a.reps):
            for name, port in entries:
                sent.append((name, n, *send(port, [rng.randrange(1000, 40000)
                                                   for _ in range(n)])))
                time.sleep(a.gap_s)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json.gz"
        subprocess.run([sys.executable, "-m", "bench", "trace-live", "--out", str(path)],
                       check=True, stdout=subprocess.DEVNULL)
        trace = json.loads(gzip.decompress(path.read_bytes()))
    result = split(sent, trace)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "command": "python -m studies.serve_path.idle_hops " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "median_ms": result}, indent=1) + "\n")
    for entry, by_len in result.items():
        for n, row in by_len.items():
            print(f"{entry:8s} {n:>5s} tokens: " + ", ".join(
                f"{k} {row[k]:.2f}" for k in PARTS) + f" ms ({row['requests']} requests)")


if __name__ == "__main__":
    main()
