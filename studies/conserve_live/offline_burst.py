"""How long a burst of offline HTTP requests delays online ones (a probe).

    RAY_AUTH_MODE=disabled serve run studies/configs/coserve_conserve.yaml &
    python -m studies.conserve_live.offline_burst --base-url http://127.0.0.1:8000 \
        --offline 300 --out studies/conserve_live/offline_burst.json

One online streaming request first (warm-up), then OFFLINE offline
completions sent at once and a streaming online request at each of a few
offsets after them; prints and writes each online request's time to its first
token.  The offline requests are cancelled (their clients hang up) once the
online ones have their first token.

It also reads, from /proc, the CPU time each Serve process of the
application spent over the burst (the probe runs on the server's machine),
and over as long a quiet stretch before it: where the burst's cost lands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx

from studies.serve_cpu import cpu_diff, cpu_s

PROMPT = "Summarize the history of the printing press in a few paragraphs. " * 3
OFFSETS_S = (0.05, 0.2, 0.5, 1.0, 1.5, 2.5, 4.0)


async def _offline(c: httpx.AsyncClient, base: str, i: int) -> None:
    try:
        await c.post(f"{base}/v1/completions", json={
            "prompt": PROMPT + str(i), "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "job_class": "offline"})
    except httpx.HTTPError:
        pass


async def _online(c: httpx.AsyncClient, base: str, delay: float) -> tuple[float, float]:
    """(seconds to the response's headers, seconds to the first token).  The
    Ingress sends the headers once the request has started (admitted, its
    engine stream opened), so the first part is the door's and the HTTP
    proxy's, the rest the Scheduler's and the engine's."""
    await asyncio.sleep(delay)
    t0 = time.perf_counter()
    async with c.stream("POST", f"{base}/v1/completions", json={
            "prompt": "Tell me about cats.", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        headers = time.perf_counter() - t0
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"text"' in line:
                break
    return headers, time.perf_counter() - t0


async def run(base: str, offline: int) -> dict[str, object]:
    limits = httpx.Limits(max_connections=offline + 100, max_keepalive_connections=offline + 100)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        _, warm = await _online(c, base, 0.0)
        quiet0 = cpu_s()
        await asyncio.sleep(OFFSETS_S[-1] + 1.0)
        cpu0 = cpu_s()
        t0 = time.perf_counter()
        offs = [asyncio.create_task(_offline(c, base, i)) for i in range(offline)]
        ttfts = await asyncio.gather(*(_online(c, base, d) for d in OFFSETS_S))
        for t in offs:
            t.cancel()
        await asyncio.gather(*offs, return_exceptions=True)
        span = time.perf_counter() - t0
        cpu1 = cpu_s()
    quiet1 = dict(cpu0)
    return {"offline_requests": offline, "warm_ttft_s": round(warm, 3),
            "online_ttft_s_by_offset_s": {str(d): round(t[1], 3)
                                          for d, t in zip(OFFSETS_S, ttfts)},
            "online_headers_s_by_offset_s": {str(d): round(t[0], 3)
                                             for d, t in zip(OFFSETS_S, ttfts)},
            # From the burst to the last offline request's cancellation.
            "burst_span_s": round(span, 2),
            "cpu_s_over_burst": cpu_diff(cpu0, cpu1),
            "cpu_s_quiet_before": {"span_s": OFFSETS_S[-1] + 1.0,
                                   **cpu_diff(quiet0, quiet1)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--offline", type=int, default=300)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = asyncio.run(run(args.base_url, args.offline))
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
