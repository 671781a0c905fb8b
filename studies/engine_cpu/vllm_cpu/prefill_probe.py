"""Time to first token on an idle server, one prompt at a time, by prompt
length: distinct prompts of random token ids (so that no prefix cache
serves any of them), `max_tokens` 1, greedy; medians of `--reps`.

    python studies/engine_cpu/vllm_cpu/prefill_probe.py --base-url http://127.0.0.1:8000/v1 \\
        --out prefill_ours.json      # prefill_probe.sh runs it on both servers

With `--other-url` (and `--other-model`) a second server, up at the same
time, takes turns with the first, request by request, each first in turn,
so that the host's phase moves both alike; the JSON then also holds the
second's times and, per length, the first's median over the second's
(prefill_pair.sh).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request
from typing import Any


def _summary(ts: list[float]) -> dict[str, Any]:
    return {"median_ms": round(statistics.median(ts), 1), "min_ms": round(min(ts), 1),
            "all_ms": [round(t, 1) for t in ts]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--other-url", help="a second server, alternated with the first")
    ap.add_argument("--other-model", default="smollm2")
    ap.add_argument("--lens", default="16,128,512,1024,2000")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    servers = [(a.base_url, a.model)] + ([(a.other_url, a.other_model)] if a.other_url else [])

    def seconds(n: int, url: str, model: str) -> float:
        ids = [rng.randrange(1000, 40000) for _ in range(n)]
        body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}
        req = urllib.request.Request(url + "/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
        return time.perf_counter() - start

    for url, model in servers:
        seconds(8, url, model)  # the first request's one-off costs
    out: list[dict[str, Any]] = [{} for _ in servers]
    for n in (int(v) for v in a.lens.split(",")):
        ts: list[list[float]] = [[] for _ in servers]
        for r in range(a.reps):
            order = range(len(servers)) if r % 2 == 0 else reversed(range(len(servers)))
            for i in order:
                ts[i].append(1e3 * seconds(n, *servers[i]))
        for i, t in enumerate(ts):
            out[i][str(n)] = _summary(t)
        line = ", ".join(f"median {o[str(n)]['median_ms']} ms (min {o[str(n)]['min_ms']})"
                         for o in out)
        print(f"{n:5d} tokens: {line}", flush=True)
    if a.out:
        report: dict[str, Any] = {"base_url": a.base_url, "reps": a.reps, "ttft": out[0]}
        if a.other_url:
            report |= {"other_url": a.other_url, "other_ttft": out[1], "ratio": {
                n: round(out[0][n]["median_ms"] / out[1][n]["median_ms"], 3) for n in out[0]}}
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
