"""The load client: replays a workload against any OpenAI-compatible server.

Async (httpx), streaming (SSE, `data: ...` lines ending with `data: [DONE]`),
on /v1/completions or /v1/chat/completions.  Each request is sent at its
workload arrival time (open loop, as vLLM's `benchmark_serving.py`), with
its output length fixed by `max_tokens` + `ignore_eos` (+ `min_tokens`),
so that every system under test generates the same number of tokens.

Per request it records (bench/records.py) the send time, the arrival time
of every chunk that carries a token, the end, the token counts (from the
`usage` of the last chunk when the server sends one, `stream_options.
include_usage`; otherwise the number of token chunks), and any error.

Our server may add per-request scheduling figures to a chunk, as an object
under one of `METRICS_KEYS` (top level or inside `usage`), with any of the
fields in `_METRIC_FIELDS` (queueing / execution / swap time, preemptions,
swap bytes): these fill the latency breakdown (FastServe Figures 1, 15b).

Admission control: an HTTP 429 answer is recorded as a rejection (with the
server's Retry-After, in seconds), not as an error.

Per-request variants (`RequestVariant`, by request id) change one request's
body (n > 1, stop strings, logprobs) or make the client hang up on purpose
at a given phase: right after the request is written (before any response),
once the response headers arrived (before the first token), or after a
number of token chunks.  Hanging up closes the connection, as a user
closing a tab would; the record says where (`RequestRecord.dropped`).

Bounded: the number of requests is the workload's; `max_duration` stops
sending and cuts off streams at a deadline; `request_timeout` bounds each
request; `max_concurrency` caps requests in flight.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import email.utils
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

import httpx
from pydantic import BaseModel, ConfigDict, Field

from bench.records import DropPhase, RequestRecord
from bench.workload import RequestSpec

METRICS_KEYS = ("metrics", "x_metrics", "server_metrics")
_METRIC_FIELDS: dict[str, tuple[str, type]] = {
    "queue_time": ("queueing_time", float),
    "queueing_time": ("queueing_time", float),
    "time_in_queue": ("queueing_time", float),
    "execution_time": ("execution_time", float),
    "exec_time": ("execution_time", float),
    "swap_time": ("swap_time", float),
    "swap_wait_time": ("swap_time", float),
    "num_preemptions": ("num_preemptions", int),
    "preemptions": ("num_preemptions", int),
    "swap_bytes": ("swap_bytes", int),
    "predicted_output_len": ("predicted_output_tokens", int),
    "prediction_delay": ("prediction_delay_s", float),
}


class ClientConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base_url: str = "http://127.0.0.1:8000/v1"
    endpoint: Literal["completions", "chat"] = "completions"
    # None: the first model listed by GET /models.
    model: str | None = None
    api_key: str | None = None
    ignore_eos: bool = True
    send_min_tokens: bool = True
    temperature: float = 0.0
    # Every request asks for this many tokens at most and ends by itself
    # (no ignore_eos, no min_tokens): the model's own answer lengths, e.g. to
    # measure length estimates.  None: each request's workload length.
    max_tokens: int | None = Field(None, ge=1)
    include_usage: bool = True
    max_concurrency: int | None = Field(None, ge=1)
    request_timeout: float = Field(600.0, gt=0)
    # Stop sending, and cut off open streams, this long after the start.
    max_duration: float | None = Field(None, gt=0)
    # Extra JSON fields for every request, and per job class (how an
    # offline request is tagged for co-serving).
    extra_body: dict[str, Any] = Field(default_factory=dict)
    # Send a refused request (429) again after its Retry-After, while time
    # is left (what a saturated probe needs under admission control).
    retry_rejected: bool = False
    class_extra_body: dict[str, dict[str, Any]] = Field(
        default_factory=lambda: {"offline": {"job_class": "offline"}}
    )


class RequestVariant(BaseModel):
    """How one request departs from the run's defaults."""

    model_config = ConfigDict(extra="forbid")

    # Merged into the JSON body last (e.g. {"n": 2}, {"stop": ["."]}).
    extra_body: dict[str, Any] = Field(default_factory=dict)
    # Body fields to leave out (min_tokens would keep a stop string from
    # ending the request).
    drop_keys: list[str] = Field(default_factory=list)
    # Hang up at this phase; mid_stream after `drop_after_chunks` streamed
    # chunks that carry tokens (up to `stream_interval` tokens each).
    drop: DropPhase | None = None
    drop_after_chunks: int = Field(1, ge=1)


class HTTPStatusError(RuntimeError):
    """A non-200 answer other than 429."""


class StreamError(RuntimeError):
    """An error event inside a 200 stream."""


class IncompleteStream(RuntimeError):
    """The stream closed before `data: [DONE]`."""


class _Rejected(Exception):
    def __init__(self, retry_after: float | None) -> None:
        super().__init__("rejected")
        self.retry_after = retry_after


class _Dropped(Exception):
    def __init__(self, phase: DropPhase) -> None:
        super().__init__(phase)
        self.phase = phase


def parse_retry_after(value: str | None, now: _dt.datetime | None = None) -> float | None:
    """Retry-After in seconds: delta-seconds, or an HTTP date (RFC 9110)."""
    if value is None or not value.strip():
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return max((when - now).total_seconds(), 0.0)


@dataclass
class _Progress:
    token_times: list[float] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    server: dict[str, Any] = field(default_factory=dict)
    done: bool = False
    token_ids: list[int] | None = None


def _url(base: str, path: str) -> str:
    return base.rstrip("/") + "/" + path.lstrip("/")


def settings_sent(cfg: ClientConfig) -> dict[str, Any]:
    """What every request of a run is sent beyond its workload, as
    `request_body` applies the config (a run's record of its client): under
    a `max_tokens` cap answers end by themselves, so neither `ignore_eos`
    nor `min_tokens` goes out."""
    capped = cfg.max_tokens is not None
    return {**cfg.model_dump(exclude={"base_url", "endpoint", "model", "api_key"}),
            "ignore_eos": cfg.ignore_eos and not capped,
            "send_min_tokens": cfg.send_min_tokens and not capped}


def request_body(cfg: ClientConfig, model: str, req: RequestSpec,
                 variant: RequestVariant | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": cfg.max_tokens or req.output_tokens,
        "temperature": cfg.temperature,
        "stream": True,
    }
    prompt = req.prompt if req.prompt is not None else ""
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.include_usage:
        body["stream_options"] = {"include_usage": True}
    run_wide = settings_sent(cfg)
    if run_wide["ignore_eos"]:
        body["ignore_eos"] = True
    if run_wide["send_min_tokens"]:
        body["min_tokens"] = req.output_tokens
    body.update(cfg.extra_body)
    body.update(cfg.class_extra_body.get(req.job_class, {}))
    if req.priority:
        body["priority"] = req.priority
    if variant is not None:
        for k in variant.drop_keys:
            body.pop(k, None)
        body.update(variant.extra_body)
    return body


def _is_token_chunk(choice: dict[str, Any], chat: bool) -> bool:
    """Does this streamed choice carry (at least) one generated token?

    A chunk with text counts; so does an empty-text chunk that does not
    end the stream (a token whose text is held back); a role-only opening
    chunk or a bare finish chunk does not.
    """
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if text is None:
            return False
        return bool(text) or (choice.get("finish_reason") is None and "role" not in delta)
    text = choice.get("text")
    if text is None:
        return False
    return bool(text) or choice.get("finish_reason") is None


def _server_metrics(obj: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for holder in (obj, obj.get("usage") or {}):
        for key in METRICS_KEYS:
            m = holder.get(key)
            if isinstance(m, dict):
                for k, v in m.items():
                    if k in _METRIC_FIELDS and v is not None:
                        name, typ = _METRIC_FIELDS[k]
                        found[name] = typ(v)
    return found


def handle_event(data: str, prog: _Progress, now: float, chat: bool) -> None:
    """Apply one SSE `data:` payload to the request's progress."""
    if data == "[DONE]":
        prog.done = True
        return
    obj = json.loads(data)
    if "error" in obj and not obj.get("choices"):
        err = obj["error"]
        raise StreamError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
    counted = False
    for choice in obj.get("choices") or []:
        if not counted and _is_token_chunk(choice, chat):
            prog.token_times.append(now)
            counted = True
        ids = choice.get("token_ids")
        if ids and choice.get("index", 0) == 0:  # `return_token_ids`: ids since the last chunk
            if prog.token_ids is None:
                prog.token_ids = []
            prog.token_ids += ids
    if obj.get("usage"):
        prog.usage = obj["usage"]
    prog.server.update(_server_metrics(obj))


async def _stream(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    model: str,
    req: RequestSpec,
    prog: _Progress,
    clock: Callable[[], float],
    variant: RequestVariant | None = None,
) -> None:
    path = "chat/completions" if cfg.endpoint == "chat" else "completions"
    chat = cfg.endpoint == "chat"
    drop = variant.drop if variant is not None else None
    extensions: dict[str, Any] = {}
    if drop == "after_send":
        extensions["trace"] = _hang_up_after_send
    async with client.stream(
        "POST", _url(cfg.base_url, path), json=request_body(cfg, model, req, variant),
        extensions=extensions,
    ) as resp:
        if resp.status_code == 429:
            await resp.aread()
            raise _Rejected(parse_retry_after(resp.headers.get("retry-after")))
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")[:300]
            raise HTTPStatusError(f"HTTP {resp.status_code}: {body}")
        if drop == "before_first_chunk":
            raise _Dropped("before_first_chunk")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            handle_event(line[5:].strip(), prog, clock(), chat)
            if prog.done:
                return
            if (drop == "mid_stream" and variant is not None
                    and len(prog.token_times) >= variant.drop_after_chunks):
                raise _Dropped("mid_stream")
    raise IncompleteStream("stream ended without [DONE]")


async def _hang_up_after_send(event: str, info: dict[str, Any]) -> None:
    """httpcore trace hook: abort once the request body is written, before
    any answer is read; httpcore then closes the connection (a request cut
    off mid-exchange is never put back in the pool)."""
    if event == "http11.send_request_body.complete":
        raise _Dropped("after_send")


async def _one(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    model: str,
    req: RequestSpec,
    t0: float,
    sem: asyncio.Semaphore | None,
    variant: RequestVariant | None = None,
) -> RequestRecord:
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    rec = RequestRecord(
        request_id=req.request_id,
        job_class=req.job_class,
        scheduled_time=req.arrival_time,
        send_time=req.arrival_time,
        prompt_tokens=req.prompt_tokens,
        expected_output_tokens=req.output_tokens,
    )
    if cfg.max_duration is not None and req.arrival_time >= cfg.max_duration:
        rec.error = "not sent: past max_duration"
        return rec
    delay = req.arrival_time - clock()
    if delay > 0:
        await asyncio.sleep(delay)
    if sem is not None:
        await sem.acquire()
    prog = _Progress()
    try:
        while True:
            timeout = cfg.request_timeout
            if cfg.max_duration is not None:
                timeout = min(timeout, max(cfg.max_duration - clock(), 0.001))
            rec.send_time = clock()
            try:
                # wait_for rather than asyncio.timeout: Python 3.10 has no timeout().
                await asyncio.wait_for(
                    _stream(client, cfg, model, req, prog, clock, variant), timeout)
                break
            except _Rejected as e:
                pause = e.retry_after if e.retry_after is not None else 1.0
                if not cfg.retry_rejected or (cfg.max_duration is not None
                                              and clock() + pause >= cfg.max_duration):
                    raise
                rec.num_rejections += 1
                await asyncio.sleep(pause)
        rec.end_time = clock()
    except _Rejected as e:
        rec.rejected = True
        rec.retry_after = e.retry_after
        rec.end_time = clock()
    except _Dropped as e:
        rec.dropped = e.phase
        rec.end_time = clock()
    except asyncio.TimeoutError:
        rec.error = "timeout"
    except Exception as e:  # noqa: BLE001 - every failure is a recorded error
        rec.error = f"{type(e).__name__}: {e}"[:500]
    finally:
        if sem is not None:
            sem.release()
    rec.token_times = prog.token_times
    rec.token_ids = prog.token_ids
    usage = prog.usage or {}
    rec.output_tokens = int(usage.get("completion_tokens") or len(prog.token_times))
    if usage.get("prompt_tokens"):
        rec.prompt_tokens = int(usage["prompt_tokens"])
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        rec.cached_tokens = int(cached)
    for k, v in prog.server.items():
        setattr(rec, k, v)
    return rec


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str:
    resp = await client.get(_url(base_url, "models"))
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/models lists no model")
    return str(data[0]["id"])


@dataclass
class LiveRun:
    records: list[RequestRecord]
    model: str
    wall_time: float


async def run_requests_async(
    requests: Sequence[RequestSpec],
    cfg: ClientConfig,
    variants: Mapping[str, RequestVariant] | None = None,
) -> LiveRun:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=64)
    timeout = httpx.Timeout(cfg.request_timeout, connect=30.0)
    async with httpx.AsyncClient(
        headers=headers, limits=limits, timeout=timeout, trust_env=False
    ) as client:
        model = cfg.model or await discover_model(client, cfg.base_url)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        t0 = time.perf_counter()
        var = variants or {}
        records = await asyncio.gather(
            *(_one(client, cfg, model, r, t0, sem, var.get(r.request_id)) for r in requests)
        )
        return LiveRun(records=list(records), model=model, wall_time=time.perf_counter() - t0)


def run_requests(
    requests: Sequence[RequestSpec],
    cfg: ClientConfig,
    variants: Mapping[str, RequestVariant] | None = None,
) -> LiveRun:
    return asyncio.run(run_requests_async(requests, cfg, variants))


def scrape_prometheus(url: str, timeout: float = 5.0) -> dict[str, float]:
    """Counters of a Prometheus text endpoint (server-wide preemptions,
    swap bytes); label sets are kept in the name."""
    out: dict[str, float] = {}
    text = httpx.get(url, timeout=timeout, trust_env=False).text
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out
