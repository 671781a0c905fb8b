"""A tiny in-process OpenAI-compatible streaming server for client tests.

Starlette app served by uvicorn on 127.0.0.1 (a free port) in a background
thread.  It streams one SSE chunk per token with a small sleep, then a
usage chunk carrying per-request scheduling metrics, then [DONE].  A
prompt of "fail" gets HTTP 500; a prompt of "hang" streams slowly; a prompt
of "busy" gets HTTP 429 with `Retry-After: 2`, and so does any request
beyond `max_active` streams at once (admission control).

`FakeEngine` counts what an engine would: streams open, KV blocks held
(each stream holds `BLOCKS_PER_STREAM` while it runs) and how streams
ended; with `leak_on_disconnect` a stream the client dropped keeps its
blocks, the bug the disconnect check must catch.  `FakeStats` reads it as
the bench's server stats source (bench/server_stats.py) does a real server.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

TOKEN_DELAY = 0.01
NUM_BLOCKS = 10_000
BLOCKS_PER_STREAM = 2


@dataclass
class FakeEngine:
    max_active: int | None = None
    leak_on_disconnect: bool = False
    # A request asking for `return_token_ids` gets ids that depend on its
    # prompt and position alone; with `perturb_shared`, a token generated
    # while another stream runs comes out one higher (a batch-variant engine).
    perturb_shared: bool = False
    num_preemptions: int = 2
    cached_tokens: int = 0
    # Responses admitted and not yet over (admission control counts these).
    admitted: int = 0
    active: int = 0
    free_blocks: int = NUM_BLOCKS
    ended: dict[str, int] = field(default_factory=dict)

    def end(self, how: str) -> None:
        self.ended[how] = self.ended.get(how, 0) + 1


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Admitted(StreamingResponse):
    """Gives the admission slot back when the response is over, however it
    ends (a client gone before the body starts never runs the generator)."""

    def __init__(self, eng: FakeEngine, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.eng = eng

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.eng.admitted -= 1


def _reject(retry_after: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": "server overloaded", "type": "rate_limit_error", "code": 429}},
        status_code=429, headers={"Retry-After": retry_after})


def make_app(engine: FakeEngine | None = None) -> Starlette:
    bodies: list[dict[str, Any]] = []
    eng = engine or FakeEngine()

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def stream(request: Request, chat: bool) -> Any:
        body = await request.json()
        bodies.append(body)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if prompt == "fail":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if prompt == "busy":
            return _reject("2")
        if eng.max_active is not None and eng.admitted >= eng.max_active:
            return _reject("1")
        eng.admitted += 1
        n = int(body["max_tokens"])
        delay = 1.0 if prompt == "hang" else TOKEN_DELAY

        async def gen() -> Any:
            # Running: the stream holds its blocks until it ends, however it
            # ends (a stream cut off before it starts never holds any).
            eng.active += 1
            eng.free_blocks -= BLOCKS_PER_STREAM
            how = "disconnected"
            try:
                async for chunk in tokens():
                    yield chunk
                how = "completed"
            finally:
                eng.active -= 1
                if how == "completed" or not eng.leak_on_disconnect:
                    eng.free_blocks += BLOCKS_PER_STREAM
                eng.end(how)

        async def tokens() -> Any:
            if chat:
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
            for i in range(n):
                await asyncio.sleep(delay)
                last = i == n - 1
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
                if chat:
                    choice["delta"] = {"content": f" t{i}"}
                else:
                    choice["text"] = f" t{i}"
                if body.get("return_token_ids"):
                    tid = (sum(map(ord, prompt)) * 31 + i) % 1000
                    choice["token_ids"] = [tid + (eng.perturb_shared and eng.active > 1)]
                yield _sse({"id": "x", "choices": [choice]})
            yield _sse({"id": "x", "choices": [], "usage": {
                "prompt_tokens": len(prompt.split()), "completion_tokens": n,
                "total_tokens": n + len(prompt.split()),
                "prompt_tokens_details": {"cached_tokens": eng.cached_tokens}},
                "metrics": {"queue_time": 0.005, "num_preemptions": eng.num_preemptions,
                            "swap_bytes": 4096,
                            "predicted_output_len": 37, "prediction_delay": 0.25}})
            yield "data: [DONE]\n\n"

        return _Admitted(eng, gen(), media_type="text/event-stream")

    async def completions(request: Request) -> Any:
        return await stream(request, chat=False)

    async def chat(request: Request) -> Any:
        return await stream(request, chat=True)

    app = Starlette(routes=[
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ])
    app.state.bodies = bodies
    app.state.engine = eng
    return app


class FakeServer:
    def __init__(self, engine: FakeEngine | None = None) -> None:
        self.engine = engine or FakeEngine()
        self.app = make_app(self.engine)
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return self.app.state.bodies

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def running() -> Iterator[FakeServer]:
    with FakeServer() as s:
        yield s


class FakeStats:
    """The bench's server stats source over a `FakeEngine`: one engine
    replica, and a host KV tier that holds nothing."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def engines(self) -> list[dict[str, Any]]:
        e = self.engine
        return [{"replica": "fake-0", "free_blocks": e.free_blocks, "num_blocks": NUM_BLOCKS,
                 "open_streams": e.active, "num_running": e.active, "num_waiting": 0,
                 "swap": {"host_used_blocks": 0},
                 "engine": {"dtype": "float32", "deterministic": not e.perturb_shared}}]

    def scheduler(self) -> dict[str, Any] | None:
        return {"active_jobs": self.engine.active, "kv_tier": {"used_bytes": 0}}
