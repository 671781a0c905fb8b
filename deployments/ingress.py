"""The Ingress deployment: OpenAI-compatible HTTP in front of the engines.

Parses and validates requests, renders the chat template, tokenizes, asks
the Scheduler deployment where the job goes, and streams the engine's output
back as OpenAI responses (SSE when `stream` is true).  A client that goes
away cancels the engine stream, which aborts the job and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator

from pydantic import ValidationError
from ray import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.config import AppConfig
from app.errors import APIError, validation_error
from app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    Usage,
    new_id,
    now_s,
)

log = logging.getLogger("ray.serve")


@serve.deployment(name="Ingress", max_ongoing_requests=4096)
@serve.ingress()
class Ingress:
    def __init__(self, config: dict[str, Any], scheduler: Any, engine: Any,
                 predictor: Any = None) -> None:
        from transformers import AutoTokenizer

        from engine.model_source import resolve_model

        self.cfg = AppConfig(**config)
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model(self.cfg.model))
        self.vocab_size = len(self.tokenizer)
        self.scheduler = scheduler
        self.engine = engine.options(stream=True)
        self.engine_calls = engine
        self.predictor = predictor
        self._background: set[asyncio.Task[Any]] = set()

    def __serve_build_asgi_app__(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={APIError: _api_error},
        )

    # Endpoints ------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        return JSONResponse({
            "object": "list",
            "data": [{
                "id": self.cfg.model_name,
                "object": "model",
                "created": now_s(),
                "owned_by": "preempt-serve",
                "max_model_len": self.cfg.max_model_len,
            }],
        })

    async def completions(self, request: Request) -> Response:
        req = await self._parse(request, CompletionRequest)
        text: str | None = None  # token-id prompts are decoded only if predicted
        if isinstance(req.prompt, str):
            ids = self.tokenizer(req.prompt)["input_ids"]
            text = req.prompt
        else:
            ids = list(req.prompt)
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        return await self._serve(req, ids, chat=False, text=text)

    async def chat_completions(self, request: Request) -> Response:
        req = await self._parse(request, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template may reject a role order
            raise APIError(400, f"messages do not fit the chat template: {e}", "messages")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if req.max_completion_tokens is not None and req.max_tokens is None:
            req.max_tokens = req.max_completion_tokens
        users = [m["content"] for m in messages if m["role"] == "user"]
        return await self._serve(req, ids, chat=True, text=users[-1] if users else text)

    # Plumbing -------------------------------------------------------------

    async def _parse(self, request: Request, model: type) -> Any:
        body = await request.body()
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}")
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e)
        if req.model is not None and req.model != self.cfg.model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server "
                           f"serves {self.cfg.model_name!r}", "model", "model_not_found")
        return req

    def _generate_request(self, req: Any, ids: list[int]) -> GenerateRequest:
        limit = self.cfg.max_model_len
        if len(ids) >= limit:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's maximum "
                           f"context length is {limit} tokens", "messages" if hasattr(req, "messages") else "prompt")
        max_tokens = req.max_tokens if req.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, "
                           f"but {len(ids)} prompt tokens + max_tokens={max_tokens} exceed it",
                           "max_tokens")
        if req.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens={req.min_tokens} exceeds max_tokens={max_tokens}",
                           "min_tokens")
        return GenerateRequest(
            request_id=new_id("cmpl"), prompt_token_ids=ids, max_tokens=max_tokens,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
            stop=req.stop or [], stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, arrival_time=time.time())

    async def _serve(self, req: Any, ids: list[int], chat: bool, text: str | None) -> Response:
        gen = self._generate_request(req, ids)
        replica = await self.scheduler.admit.remote(
            gen.request_id, len(ids), gen.max_tokens, gen.job_class)
        stream = self.engine.generate.remote(gen.model_dump(), replica=replica)
        if self.predictor is not None:
            self._predict(gen.request_id, text if text is not None else self.tokenizer.decode(ids),
                          replica)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._sse(gen, stream, chat, include_usage, len(ids)),
                media_type="text/event-stream")
        return await self._collect(gen, stream, chat, len(ids))

    def _predict(self, request_id: str, text: str, replica: str | None) -> None:
        """Ask for the response length beside the job, never before it
        (EconoServe §3.3.2): the job starts at once with an unknown length,
        and the engine learns the estimate whenever it lands."""
        from deployments.predictor import request_prediction

        task = request_prediction(self.predictor, text)

        def landed(t: "asyncio.Task[Any]") -> None:
            pred = None if t.cancelled() else t.result()
            if pred is not None:
                self._background_call(self.engine_calls.set_prediction.remote(
                    request_id, pred["predicted_len"], replica=replica))

        task.add_done_callback(landed)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _background_call(self, call: Any) -> None:
        task = asyncio.ensure_future(call)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _release(self, request_id: str, outcome: str) -> None:
        self._background_call(self.scheduler.release.remote(request_id, outcome))

    async def _collect(self, gen: GenerateRequest, stream: Any, chat: bool, n_prompt: int) -> Response:
        text, n_out, finish, metrics = [], 0, None, None
        outcome = "aborted"
        try:
            async for d in stream:
                text.append(d["text"])
                n_out += len(d["token_ids"])
                if d["finish_reason"] is not None:
                    finish, metrics = d["finish_reason"], d["metrics"]
            outcome = finish or "aborted"
        except ValueError as e:
            outcome = "error"
            raise APIError(400, str(e))
        finally:
            stream.cancel()
            self._release(gen.request_id, outcome)
        usage = Usage(prompt_tokens=n_prompt, completion_tokens=n_out,
                      total_tokens=n_prompt + n_out).model_dump()
        body_text = "".join(text)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": body_text},
                      "finish_reason": finish, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": body_text, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return JSONResponse({
            "id": gen.request_id, "object": obj, "created": now_s(),
            "model": self.cfg.model_name, "choices": [choice], "usage": usage,
            "metrics": metrics,
        })

    async def _sse(self, gen: GenerateRequest, stream: Any, chat: bool,
                   include_usage: bool, n_prompt: int) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = now_s()
        n_out = 0
        outcome = "aborted"

        def chunk(delta_text: str | None, finish: str | None, role: bool = False,
                  extra: dict[str, Any] | None = None) -> str:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if delta_text is not None:
                    delta["content"] = delta_text
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish,
                          "logprobs": None}
            body = {"id": gen.request_id, "object": obj, "created": created,
                    "model": self.cfg.model_name, "choices": [choice]}
            if extra:
                body.update(extra)
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                yield chunk("", None, role=True)
            async for d in stream:
                n_out += len(d["token_ids"])
                finish = d["finish_reason"]
                if d["text"] or finish is None:
                    yield chunk(d["text"], None)
                if finish is not None:
                    outcome = finish
                    yield chunk(None if chat else "", finish,
                                extra={"metrics": d["metrics"]})
            if include_usage:
                usage = Usage(prompt_tokens=n_prompt, completion_tokens=n_out,
                              total_tokens=n_prompt + n_out).model_dump()
                yield (f"data: {json.dumps({'id': gen.request_id, 'object': obj, 'created': created, 'model': self.cfg.model_name, 'choices': [], 'usage': usage})}\n\n")
            yield "data: [DONE]\n\n"
        except ValueError as e:
            outcome = "error"
            err = {"error": {"message": str(e), "type": "invalid_request_error", "code": 400}}
            yield f"data: {json.dumps(err)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            stream.cancel()
            self._release(gen.request_id, outcome)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status)
