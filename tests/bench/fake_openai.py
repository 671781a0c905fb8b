"""A tiny in-process OpenAI-compatible streaming server for client tests.

Starlette app served by uvicorn on 127.0.0.1 (a free port) in a background
thread.  It streams one SSE chunk per token with a small sleep, then a
usage chunk carrying per-request scheduling metrics, then [DONE].  A
prompt of "fail" gets HTTP 500; a prompt of "hang" streams slowly.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

TOKEN_DELAY = 0.01


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def make_app() -> Starlette:
    bodies: list[dict[str, Any]] = []

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def stream(request: Request, chat: bool) -> Any:
        body = await request.json()
        bodies.append(body)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if prompt == "fail":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        n = int(body["max_tokens"])
        delay = 1.0 if prompt == "hang" else TOKEN_DELAY

        async def gen() -> Any:
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
                yield _sse({"id": "x", "choices": [choice]})
            yield _sse({"id": "x", "choices": [], "usage": {
                "prompt_tokens": len(prompt.split()), "completion_tokens": n,
                "total_tokens": n + len(prompt.split())},
                "metrics": {"queue_time": 0.005, "num_preemptions": 2, "swap_bytes": 4096}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

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
    return app


class FakeServer:
    def __init__(self) -> None:
        self.app = make_app()
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
