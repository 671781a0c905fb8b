"""Control overhead of the running Serve application at a given batch size.

Starts the application in-process (or uses `--base-url`), sends `--batch`
concurrent streaming completions of fixed length (`ignore_eos`), and
compares, over the same window:

- the engine loop's wall time against its forward time (planning,
  bookkeeping and handing tokens over, between two forward passes), and
- the client-observed inter-token latency against the median forward time
  of one iteration (adds the streaming RPC and HTTP path), and
- the run's wall time against its summed forward time: all that is not a
  forward pass, end to end.

    python -m studies.engine_cpu.serve_overhead --batch 32 --out studies/engine_cpu/serve_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import httpx


async def _one(client: httpx.AsyncClient, base: str, prompt: str, n: int) -> list[float]:
    body = {"prompt": prompt, "max_tokens": n, "ignore_eos": True, "temperature": 0,
            "stream": True}
    stamps: list[float] = []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return stamps


async def _load(base: str, batch: int, n: int) -> list[list[float]]:
    prompts = [f"Request {i}: write a long story about a lighthouse keeper." for i in range(batch)]
    async with httpx.AsyncClient(timeout=600) as client:
        return await asyncio.gather(*(_one(client, base, p, n) for p in prompts))


def measure(base: str, engine_stats, batch: int, n: int) -> dict:
    asyncio.run(_load(base, 2, 4))  # warm-up
    before = engine_stats()
    t0 = time.perf_counter()
    stamps = asyncio.run(_load(base, batch, n))
    wall = time.perf_counter() - t0
    after = engine_stats()
    iters = after["iterations"] - before["iterations"]
    fwd = after["forward_time"] - before["forward_time"]
    loop = after["loop_time"] - before["loop_time"]
    # Inter-token gaps in the steady state: skip each stream's first chunks
    # (prefill, ramp-up) and last (ramp-down).
    gaps = [b - a for s in stamps for a, b in zip(s[4:-4], s[5:-4])]
    fwd_per_iter = fwd / max(1, iters)
    # Steady state: the median iteration of the window (decodes at full
    # batch), not the mean, which the prefill iterations inflate.
    recent = after["recent_forward_s"][-iters:] if iters else []
    fwd_median = statistics.median(recent) if recent else fwd_per_iter
    itl = statistics.median(gaps) if gaps else float("nan")
    return {
        "batch": batch,
        "tokens_per_request": n,
        "iterations": iters,
        "wall_s": wall,
        "forward_s": fwd,
        "loop_s": loop,
        "forward_per_iteration_ms": 1e3 * fwd_per_iter,
        "forward_median_ms": 1e3 * fwd_median,
        "loop_overhead_pct": 100 * (loop - fwd) / fwd,
        # Everything that is not a forward pass, from the first request sent
        # to the last token received: planning, RPC, delivery, HTTP.
        "wall_overhead_pct": 100 * (wall - fwd) / fwd,
        "client_itl_median_ms": 1e3 * itl,
        "client_overhead_pct": 100 * (itl - fwd_median) / fwd_median,
        "decode_tokens_per_s": sum(len(s) for s in stamps) / wall,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=Path("studies/engine_cpu/serve_overhead.json"))
    args = ap.parse_args(argv)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from app.builder import build_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8123})
    serve.run(build_app({"dtype": args.dtype, "max_batch_size": args.batch,
                         "kv_cache_tokens": 16384, "max_model_len": 1024}),
              name="llm", route_prefix="/")
    handle = serve.get_deployment_handle("Engine", app_name="llm")
    try:
        res = measure("http://127.0.0.1:8123", lambda: handle.stats.remote().result(),
                      args.batch, args.tokens)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(json.dumps(res, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
