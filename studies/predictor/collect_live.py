"""Served-completion records from the live server itself.

`collect.py` produced (prompt, length) records offline, with
`transformers.generate` (greedy, capped at 256 new tokens), before the
server could record what it served.  With `predictor.record_dir` set, the
server's Ingress now appends every finished completion to
`served-<pid>.jsonl` (deployments/served_log.py); this driver is the chat
client that makes it serve the same serving-split prompts, so that the
retraining report (`python -m predictor retrain`) is made from completions
the server produced: its own engine, its own chat framing, sampled as a chat
client samples, and with a `max_tokens` high enough that the cap rarely cuts
an answer (a cut answer is a lower bound of a length, which the retraining
drops, so a low cap biases the data towards short answers).

The server's log is the data; this client keeps a small log of its own (one
line per prompt: seed, `max_tokens`, token counts, finish reason, latency,
or the error) so that a run can be resumed and its rate and cap hits
reported.  Prompt texts are not repeated there: the server's log has them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.client import discover_model, parse_retry_after
from predictor.dataset import LengthPair


@dataclass(frozen=True)
class LiveConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    # None: the first model GET /v1/models lists (the server's own name).
    model: str | None = None
    api_key: str | None = None
    concurrency: int = 32
    # max_tokens = min(max_tokens, max_model_len - prompt tokens - margin).
    # The margin covers the chat template's tokens around the prompt
    # (SmolLM2's default system turn and role markers), which the pairs'
    # `prompt_tokens` (the bare prompt) do not count: the server refuses a
    # request whose prompt + max_tokens exceeds max_model_len.
    max_tokens: int = 1024
    margin: int = 64
    # A chat client's sampling, not greedy: the lengths a served model
    # produces for real users, who rarely send temperature 0.
    temperature: float = 0.7
    top_p: float = 0.95
    # Base of the per-prompt seeds (see `prompt_seed`).
    seed: int = 0
    request_timeout: float = 1800.0
    # Retries of a request the server refused for load (429, with its
    # Retry-After) or could not serve (503); other failures are logged once.
    max_retries: int = 5
    # Stop sending new prompts this many seconds after the start (the ones in
    # flight finish): a time budget for a CPU machine.  None: no limit.
    max_duration_s: float | None = None


def prompt_seed(base: int, prompt_id: str) -> int:
    """A seed per prompt from its id, not from its position: a resumed run, or
    one over a different number of prompts, samples each prompt the same way."""
    h = hashlib.sha256(f"{base}\0{prompt_id}".encode()).digest()
    return int.from_bytes(h[:4], "big") & 0x7FFFFFFF


def done_ids(log_path: Path) -> set[str]:
    """Prompt ids the client log already holds an answer for (errors are retried)."""
    if not log_path.is_file():
        return set()
    ids: set[str] = set()
    for line in log_path.open(encoding="utf-8"):
        if line.strip():
            row = json.loads(line)
            if row.get("error") is None:
                ids.add(row["id"])
    return ids


def _headers(cfg: LiveConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def _model_info(client: httpx.AsyncClient, cfg: LiveConfig) -> tuple[str, int | None]:
    """The model name to send and its max_model_len, as the server reports them."""
    name = cfg.model or await discover_model(client, cfg.base_url)
    resp = await client.get(cfg.base_url.rstrip("/") + "/models")
    resp.raise_for_status()
    entry = next((m for m in resp.json().get("data") or [] if m.get("id") == name), {})
    max_len = entry.get("max_model_len")
    return name, int(max_len) if max_len is not None else None


def request_max_tokens(cfg: LiveConfig, pair: LengthPair, max_model_len: int | None) -> int:
    if max_model_len is None:
        return cfg.max_tokens
    return max(1, min(cfg.max_tokens, max_model_len - pair.prompt_tokens - cfg.margin))


async def _one(
    client: httpx.AsyncClient, cfg: LiveConfig, model: str, max_model_len: int | None,
    pair: LengthPair, t0: float,
) -> dict[str, Any]:
    seed = prompt_seed(cfg.seed, pair.id)
    max_tokens = request_max_tokens(cfg, pair, max_model_len)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": pair.prompt}],
        "max_tokens": max_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "seed": seed,
    }
    row: dict[str, Any] = {"id": pair.id, "seed": seed, "max_tokens": max_tokens,
                           "sent_s": round(time.perf_counter() - t0, 3), "attempts": 0}
    url = cfg.base_url.rstrip("/") + "/chat/completions"
    start = time.perf_counter()
    error: str | None = None
    for attempt in range(cfg.max_retries + 1):
        row["attempts"] = attempt + 1
        try:
            resp = await client.post(url, json=body, headers=_headers(cfg),
                                     timeout=cfg.request_timeout)
        except httpx.HTTPError as e:  # connection reset, timeout: log it, go on
            error = f"{type(e).__name__}: {e}"[:300]
            break
        if resp.status_code in (429, 503) and attempt < cfg.max_retries:
            # Admission control or a replica restart: the server asks us to
            # come back, and a dropped prompt would bias the sample.
            wait = parse_retry_after(resp.headers.get("retry-after"))
            await asyncio.sleep(wait if wait is not None else 2.0 * (attempt + 1))
            continue
        if resp.status_code != 200:
            error = f"HTTP {resp.status_code}: {resp.text[:300]}"
            break
        data = resp.json()
        choice = data["choices"][0]
        usage = data.get("usage") or {}
        row.update({
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "finish_reason": choice.get("finish_reason"),
            "e2e_s": round(time.perf_counter() - start, 3),
            "error": None,
        })
        return row
    row.update({"error": error or "retries exhausted", "e2e_s": round(time.perf_counter() - start, 3)})
    return row


async def collect_live_async(cfg: LiveConfig, pairs: Sequence[LengthPair], log_path: Path) -> dict[str, Any]:
    """Send `pairs`' prompts (those without an answer in `log_path` yet) at
    `cfg.concurrency` in flight, appending one client-log line per prompt."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    done = done_ids(log_path)
    todo = [p for p in pairs if p.id not in done]
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    async with httpx.AsyncClient(limits=limits, timeout=cfg.request_timeout) as client:
        model, max_model_len = await _model_info(client, cfg)
        queue: asyncio.Queue[LengthPair] = asyncio.Queue()
        for p in todo:
            queue.put_nowait(p)

        async def worker() -> None:
            # A fixed pool of workers, not one task per prompt: a bounded
            # number in flight, and a time budget checked before each send.
            with log_path.open("a", encoding="utf-8") as f:
                while not queue.empty():
                    if cfg.max_duration_s is not None and time.perf_counter() - t0 > cfg.max_duration_s:
                        return
                    pair = queue.get_nowait()
                    row = await _one(client, cfg, model, max_model_len, pair, t0)
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()  # a killed run keeps every answer it got
                    if row["error"] is not None:
                        print(f"[collect-live] {pair.id}: {row['error']}", flush=True)
                    if len(rows) % 20 == 0:
                        el = time.perf_counter() - t0
                        toks = sum(r.get("completion_tokens") or 0 for r in rows)
                        print(f"[collect-live] {len(rows)}/{len(todo)} in {el:.0f} s: "
                              f"{60 * len(rows) / el:.1f} completions/min, {toks / el:.0f} tokens/s",
                              flush=True)

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
    wall = time.perf_counter() - t0
    return summarize(rows, wall, model, max_model_len, len(done), len(todo))


def summarize(rows: Sequence[dict[str, Any]], wall_s: float, model: str,
              max_model_len: int | None, skipped: int, todo: int) -> dict[str, Any]:
    ok = [r for r in rows if r["error"] is None]
    toks = sum(r.get("completion_tokens") or 0 for r in ok)
    return {
        "model": model, "max_model_len": max_model_len,
        "already_done": skipped, "todo": todo, "sent": len(rows),
        "answered": len(ok), "failed": len(rows) - len(ok),
        "hit_max_tokens": sum(r.get("finish_reason") == "length" for r in ok),
        "completion_tokens": toks, "wall_s": round(wall_s, 1),
        "completions_per_min": round(60 * len(ok) / wall_s, 2) if wall_s > 0 else None,
        "tokens_per_s": round(toks / wall_s, 1) if wall_s > 0 else None,
    }


def collect_live(cfg: LiveConfig, pairs: Sequence[LengthPair], log_path: Path) -> dict[str, Any]:
    return asyncio.run(collect_live_async(cfg, pairs, log_path))
