"""Offline requests that do not stream: tokens/s and each Serve process's CPU.

    RAY_AUTH_MODE=disabled serve run studies/configs/coserve_conserve.yaml &
    python -m studies.conserve_live.unstreamed.probe 8 16 0      # warm-up
    python -m studies.conserve_live.unstreamed.probe 64 128 0    # N requests, tokens each, stream 0/1

N offline completions at once (`ignore_eos`, greedy), all awaited; prints
one JSON line: wall time, output tokens/s and CPU seconds per Serve process
(read from /proc as `offline_burst.py` does; run it on the server's machine).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx

from studies.serve_cpu import cpu_diff, cpu_s

URL = "http://127.0.0.1:8000/v1/completions"


async def main(n: int, tokens: int, stream: bool) -> None:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n + 10)) as c:
        async def one(i: int) -> None:
            body = {"prompt": f"Write a story about number {i}.", "max_tokens": tokens,
                    "temperature": 0, "ignore_eos": True, "job_class": "offline",
                    "stream": stream}
            if stream:
                async with c.stream("POST", URL, json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
            else:
                r = await c.post(URL, json=body)
                assert r.status_code == 200, r.text

        cpu0, t0 = cpu_s(), time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall, cpu1 = time.perf_counter() - t0, cpu_s()
    print(json.dumps({"n": n, "tokens": tokens, "stream": stream, "wall_s": round(wall, 2),
                      "tok_s": round(n * tokens / wall, 1), "cpu": cpu_diff(cpu0, cpu1)}))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"))
