"""Time to first token on an idle server, one prompt at a time, by prompt
length: distinct prompts of random token ids (so that no prefix cache
serves any of them), `max_tokens` 1, greedy; medians of `--reps`.

    python studies/engine_cpu/vllm_cpu/prefill_probe.py --base-url http://127.0.0.1:8000/v1 \\
        --out prefill_ours.json      # prefill_probe.sh runs it on both servers
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lens", default="16,128,512,1024,2000")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args()
    rng = random.Random(a.seed)

    def seconds(n: int) -> float:
        ids = [rng.randrange(1000, 40000) for _ in range(n)]
        body = {"model": a.model, "prompt": ids, "max_tokens": 1, "temperature": 0}
        req = urllib.request.Request(a.base_url + "/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
        return time.perf_counter() - start

    seconds(8)  # the first request's one-off costs
    out = {}
    for n in (int(v) for v in a.lens.split(",")):
        ts = [1e3 * seconds(n) for _ in range(a.reps)]
        out[str(n)] = {"median_ms": round(statistics.median(ts), 1), "min_ms": round(min(ts), 1),
                       "all_ms": [round(t, 1) for t in ts]}
        print(f"{n:5d} tokens: median {out[str(n)]['median_ms']} ms, min {out[str(n)]['min_ms']} ms",
              flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"base_url": a.base_url, "reps": a.reps, "ttft": out}, f, indent=1)


if __name__ == "__main__":
    main()
