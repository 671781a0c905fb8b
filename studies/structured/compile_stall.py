"""Does compiling a large grammar stall the other requests' streams?

Against a running server (`serve run serve_config.yaml`): four streamed
completions decode 200 tokens each; two seconds in, one request asks for
a JSON Schema of `--fields` patterned string fields (seconds to compile on a
CPU core).  Prints, per stream, the largest gap between two tokens and the
median, and the structured request's time to its first token.

    python -m studies.structured.compile_stall --fields 300 --label side-thread \
        --out studies/structured/compile_stall.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

URL = "http://127.0.0.1:8000/v1"


def schema(fields: int, salt: str) -> dict[str, object]:
    props = {f"{salt}_{i}": {"type": "string", "pattern": "[a-z]{3,8}"} for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props)}


async def stream(client: httpx.AsyncClient, body: dict[str, object]) -> list[float]:
    times: list[float] = []
    async with client.stream("POST", f"{URL}/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return times


async def main_async(a: argparse.Namespace) -> dict[str, object]:
    async with httpx.AsyncClient(timeout=600) as client:
        free = [asyncio.create_task(stream(client, {
            "model": "smollm2", "prompt": f"Story {i}: once upon a time", "max_tokens": 200,
            "ignore_eos": True, "temperature": 0})) for i in range(4)]
        await asyncio.sleep(2.0)
        sent = time.perf_counter()
        structured = asyncio.create_task(stream(client, {
            "model": "smollm2", "prompt": "A record:", "max_tokens": 8, "temperature": 0,
            "structured_outputs": {"json": schema(a.fields, f"s{int(time.time())}")}}))
        free_times = await asyncio.gather(*free)
        st = await structured
    gaps = [[b - x for x, b in zip(t, t[1:])] for t in free_times]
    return {
        "fields": a.fields,
        "structured_first_token_s": round(st[0] - sent, 3) if st else None,
        "max_gap_s": [round(max(g), 3) for g in gaps],
        "median_gap_s": [round(statistics.median(g), 4) for g in gaps],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fields", type=int, default=300)
    ap.add_argument("--label", default="", help="what the server ran (kept with the run)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    r = {"label": a.label, **asyncio.run(main_async(a))}
    print(json.dumps(r))
    if a.out is not None:
        runs = json.loads(a.out.read_text()) if a.out.exists() else []
        a.out.write_text(json.dumps(runs + [r], indent=1) + "\n")


if __name__ == "__main__":
    main()
