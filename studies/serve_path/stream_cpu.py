"""Each Serve process's CPU per request while a running server streams answers.

Sends `-n` chat completions, `--concurrency` at a time, each `--max-tokens` tokens
(`ignore_eos`; `--temperature` where given), streamed or not, to the server at `--url` (a
429 is retried after 0.25 s and counted), and reads every Serve process's CPU time from
/proc before and after (`studies/serve_cpu.py`), and its own. Writes one JSON object:
requests/s, output tokens/s, and each process's CPU milliseconds per request (this
client's as `client`).

    python -m studies.serve_path.stream_cpu -n 160 --concurrency 24 --max-tokens 64 --stream
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp

from studies.serve_cpu import cpu_diff, cpu_s, serve_processes

URL = "http://127.0.0.1:8000/v1/chat/completions"


async def load(n: int, concurrency: int, max_tokens: int, stream: bool,
               offset: int, url: str = URL, temperature: float | None = None) -> dict[str, Any]:
    gate, retried = asyncio.Semaphore(concurrency), 0

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        nonlocal retried
        body = {"model": "smollm2", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": stream, "messages": [{"role": "user", "content":
                                                f"Say a number near {i + offset}, only that."}]}
        if temperature is not None:
            body["temperature"] = temperature
        async with gate:
            while True:
                async with s.post(url, json=body) as r:
                    text = await r.read()
                    if r.status == 429:
                        retried += 1
                        await asyncio.sleep(0.25)
                        continue
                    assert r.status == 200, text[:300]
                    return

    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(s, i) for i in range(n)))
        took = time.perf_counter() - t0
    return {"seconds": took, "requests_per_s": n / took,
            "output_tokens_per_s": n * max_tokens / took, "retried_429": retried}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--offset", type=int, default=0, help="first prompt's number")
    ap.add_argument("--url", default=URL, help=f"chat completions URL (default: {URL})")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    procs = serve_processes()
    before, client = cpu_s(procs), time.process_time()
    row = asyncio.run(load(a.n, a.concurrency, a.max_tokens, a.stream, a.offset, a.url,
                           a.temperature))
    used = cpu_diff(before, cpu_s(procs))
    used["client"] = time.process_time() - client
    row.update(label=a.label, n=a.n, concurrency=a.concurrency, max_tokens=a.max_tokens,
               stream=a.stream, temperature=a.temperature,
               cpu_ms_per_request={k: round(v / a.n * 1000, 2) for k, v in sorted(used.items())})
    text = json.dumps(row)
    if a.out == "-":
        print(text)
    else:
        with open(a.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
