"""Time to first token on an idle server, one prompt at a time, by prompt
length: distinct prompts of random token ids (so that no prefix cache
serves any of them), `max_tokens` 1, greedy; medians of `--reps`.

    python studies/engine_cpu/vllm_cpu/prefill_probe.py --base-url http://127.0.0.1:8000/v1 \\
        --out prefill_ours.json      # prefill_probe.sh runs it on both servers

With `--other-base-url` (and `--other-model`) two idle servers up at once take
turns, prompt by prompt, so that a shared host's slow and fast phases fall on
both alike (prefill_alternated.sh); the JSON then holds both and their ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request


def _summary(ts: list[float]) -> dict:
    return {"median_ms": round(statistics.median(ts), 1), "min_ms": round(min(ts), 1),
            "all_ms": [round(t, 1) for t in ts]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--other-base-url")
    ap.add_argument("--other-model", default="smollm2")
    ap.add_argument("--lens", default="16,128,512,1024,2000")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    servers = [(a.base_url, a.model)]
    if a.other_base_url:
        servers.append((a.other_base_url, a.other_model))

    def seconds(n: int, base_url: str, model: str) -> float:
        ids = [rng.randrange(1000, 40000) for _ in range(n)]
        body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}
        req = urllib.request.Request(base_url + "/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
        return time.perf_counter() - start

    for server in servers:
        seconds(8, *server)  # the first request's one-off costs
    out: list[dict] = [{} for _ in servers]
    for n in (int(v) for v in a.lens.split(",")):
        ts: list[list[float]] = [[] for _ in servers]
        for i in range(a.reps):
            # Each server first on every other turn.
            order = range(len(servers)) if i % 2 == 0 else reversed(range(len(servers)))
            for s in order:
                ts[s].append(1e3 * seconds(n, *servers[s]))
        for s, t in enumerate(ts):
            out[s][str(n)] = _summary(t)
        line = " | ".join(f"median {o[str(n)]['median_ms']} ms, min {o[str(n)]['min_ms']} ms"
                          for o in out)
        if len(servers) == 2:
            ratio = out[0][str(n)]["median_ms"] / out[1][str(n)]["median_ms"]
            line += f" | ratio of medians {ratio:.3f}"
        print(f"{n:5d} tokens: {line}", flush=True)
    if a.out:
        report: dict = {"base_url": a.base_url, "reps": a.reps, "ttft": out[0]}
        if len(servers) == 2:
            report |= {"other_base_url": a.other_base_url, "other_ttft": out[1],
                       "ratio_of_medians": {n: round(out[0][n]["median_ms"]
                                                     / out[1][n]["median_ms"], 3)
                                            for n in out[0]}}
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
