"""The Ingress deployment: OpenAI-compatible HTTP in front of the engines.

Parses and validates requests, renders the chat template, tokenizes, asks
the Scheduler deployment where the job goes, and streams the engine's output
back as OpenAI responses (SSE when `stream` is true).  A client that goes
away cancels the engine stream, which aborts the job and frees its blocks.

Batch jobs (batch/job.py) send their lines through a handle to
`batch_request`, which takes the HTTP routes' path without HTTP; the
`/v1/files` and `/v1/batches` routes are batch/routes.py's.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any, AsyncIterator

from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayActorError, TaskCancelledError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from api.admission_wire import Admission, AdmitRequest
from api.auth import BearerKeyAuth
from api.chat_store_route import ChatStoreRoute
from api.config import AppConfig
from api.errors import APIError, validation_error
from api.http import (
    JSONServerErrors,
    api_error_handler,
    http_exception_handler,
    read_json_object,
)
from api.logprobs import TokenText
from api.models_route import ModelRoutes, unknown_model
from api.openapi import build_openapi, openapi_endpoint
from api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    new_id,
    now_s,
)
from api.reasoning import check_reasoning, reasoning_format
from api.responses import PromptInput, ResponseBuilder
from api.structured import requested_structure
from api.tokenize_route import TokenizeRoutes, chat_ids, encode
from api.tool_formats import tool_format
from api.tools import ToolUse
from deployments import STOP_POLL_S
from deployments.coalesce import Coalescer
from deployments.dispatch_ahead import DispatchAhead
from deployments.engine_stream import EngineFailed, EngineRefused, engine_deltas, engine_failure
from deployments.generate_request import check_prediction, generate_request
from deployments.handles import by_value
from deployments.ingress_metrics import IngressMetrics
from deployments.lora_routes import LoraRoutes
from deployments.online_first import OnlineFirstDoor
from deployments.batch_request import answer_line
from deployments.messages_route import MessagesRoute
from deployments.responses_route import ResponsesRoute
from deployments.resume import ResumableStream
from deployments.served_log import ServedLog
from scheduler.job import JobClass
from scheduler.prefix_affinity import prefix_keys, route_key

log = logging.getLogger("ray.serve")

# How long /health waits for the Scheduler deployment's answer.
_HEALTH_TIMEOUT_S = 5.0


@serve.deployment(name="Ingress", max_ongoing_requests=4096,
                  graceful_shutdown_wait_loop_s=STOP_POLL_S)
@serve.ingress()
class Ingress:
    def __init__(self, config: dict[str, Any], scheduler: Any, engine: Any,
                 predictor: Any = None) -> None:
        from batch.jobs import RayJobs
        from batch.routes import BatchRoutes
        from batch.service import Batches
        from batch.store import BatchStore
        from engine.model_source import resolve_model
        from engine.tokenizer import eos_token_ids, load_tokenizer

        self.cfg = AppConfig(**config)
        model_path = resolve_model(self.cfg.model)
        self.tokenizer = load_tokenizer(model_path)
        self.vocab_size = len(self.tokenizer)
        self.token_text = TokenText(self.tokenizer)
        # Calls on the request path go over the replicas' gRPC data plane.
        self.scheduler = by_value(scheduler)
        self.engine = by_value(engine).options(stream=True)
        self.engine_calls = engine
        self.predictor = by_value(predictor)
        self._background: set[asyncio.Task[Any]] = set()
        # The Scheduler calls of requests arriving or ending together, one
        # call each way per round trip (deployments/coalesce.py).
        self._admits: Coalescer[dict[str, Any], dict[str, Any]] = Coalescer(
            lambda reqs: self.scheduler.admit_many.remote(reqs), orphan=self._unwanted)
        self._releases: Coalescer[tuple[str, str], None] = Coalescer(self._send_releases)
        self.door = OnlineFirstDoor(self.cfg.offline_starts)
        self._ahead = DispatchAhead(self.cfg.admission.dispatch_ahead)
        self.metrics = IngressMetrics(self.door, self._ahead)
        rec = self.cfg.predictor.record_dir
        self.served_log = (ServedLog(rec, eos_token_ids(model_path, self.tokenizer, None))
                           if rec else None)
        # Request id -> the texts its completions are recorded under, and
        # the request's stop token ids.
        self._recording: dict[str, tuple[list[str], list[int]]] = {}
        # Built from the request models now, so it always matches them.
        self.openapi = build_openapi(auth=self.cfg.api_key is not None,
                                     lora_runtime=self.cfg.lora_runtime.enabled)
        self.batches = Batches(BatchStore(self.cfg.batch.storage_path()),
                               RayJobs(self.cfg.batch.jobs_address))
        self.lora = LoraRoutes(self.cfg, lambda name, path: engine.check_lora.remote(name, path))
        self.model_routes = ModelRoutes(self.cfg.model_name, self.cfg.max_model_len,
                                        self.cfg.lora_adapters, self.lora.folders)
        self.responses_route = ResponsesRoute(self)
        self.messages_route = MessagesRoute(self)
        self.chat_store = ChatStoreRoute.for_settings(self.cfg.responses,
                                                      self.cfg.max_request_bytes)
        self.tool_format = tool_format(self.cfg.tool_call_format, self.tokenizer.chat_template)
        self.tokenize_routes = TokenizeRoutes(self.tokenizer, self.cfg, self.tool_format,
                                              lambda: list(self.model_routes.cards))
        self.batch_routes = BatchRoutes(self.batches, self.cfg.batch, _app_name,
                                        self.cfg.model_name, self.cfg.max_request_bytes)
        if self.cfg.api_key is not None:
            log.info("every route but /health requires the API key")

    def __serve_build_asgi_app__(self) -> Starlette:
        app = Starlette(
            routes=[
                *self.model_routes.routes(),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["GET", "POST"]),
                *self.chat_store.routes(),
                Route("/health", self.health, methods=["GET"]),
                Route("/openapi.json", openapi_endpoint(self.openapi), methods=["GET"]),
                *self.batch_routes.routes(),
                *self.tokenize_routes.routes(),
                *self.responses_route.routes(),
                *self.messages_route.routes(),
                *self.lora.routes(),
            ],
            middleware=[
                # Outermost: whatever escapes below still answers JSON.
                Middleware(JSONServerErrors, disconnected=(TaskCancelledError,)),
                Middleware(BearerKeyAuth, api_key=self.cfg.api_key),
            ],
            exception_handlers={APIError: api_error_handler,
                                HTTPException: http_exception_handler},
        )
        # `/v1/models/` is a 404 like any unknown path, not a redirect.
        app.router.redirect_slashes = False
        return app

    # Endpoints ------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """Readiness: 200 once an engine replica serves.  The ingress is up
        seconds before the engines have loaded their models; a client or
        load balancer that took its 200 as ready would see its first
        requests wait for the whole engine start."""
        try:
            ready = await asyncio.wait_for(self.scheduler.ready.remote(), _HEALTH_TIMEOUT_S)
        except (RayActorError, asyncio.TimeoutError) as e:
            log.warning("/health: the scheduler did not answer: %r", e)
            raise APIError(503, "the scheduler does not answer; retry",
                           type_="service_unavailable", headers={"Retry-After": "1"})
        if ready["live_engines"] < 1:
            raise APIError(503, f"no engine replica is serving yet (0 of {ready['engines']}: "
                           "loading the model or restarting); retry",
                           type_="service_unavailable", headers={"Retry-After": "1"})
        return Response(status_code=200)

    async def completions(self, request: Request) -> Response:
        req = await self.parse_body(request, CompletionRequest)
        async with self.door.start(req.job_class == "offline", req.priority):
            started = await self.start_completion(req)
        return await self._respond(req, started)

    async def chat_completions(self, request: Request) -> Response:
        if request.method == "GET":  # the stored ones (api/chat_store_route.py)
            return await self.chat_store.list(request)
        req = await self.parse_body(request, ChatCompletionRequest)
        self.chat_store.check(req)
        async with self.door.start(req.job_class == "offline", req.priority):
            started = await self.start_chat(req)
        return await self._respond(req, started)

    async def batch_request(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """One line of a batch job, through a Serve handle (deployments/
        batch_request.py)."""
        self.metrics.ensure_running()
        return await answer_line(self, url, body)

    async def start_completion(self, req: CompletionRequest
                                ) -> tuple[ResponseBuilder, Any]:
        prompts: list[PromptInput] = []
        for p in req.prompts():
            if isinstance(p, str):
                prompts.append(PromptInput(encode(self.tokenizer, p, "prompt"), p))
            else:
                ids = list(p)
                if any(not 0 <= t < self.vocab_size for t in ids):
                    raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})",
                                   "prompt")
                # Decoded only where echo or the predictor reads it.
                prompts.append(PromptInput(ids, ""))
        if req.echo or self.predictor is not None or self.served_log is not None:
            for pi in prompts:
                pi.text = pi.text or self.tokenizer.decode(pi.token_ids)
        return await self._start(req, prompts, chat=False, predict_texts=[
            pi.text for pi in prompts])

    async def start_chat(self, req: ChatCompletionRequest) -> tuple[ResponseBuilder, Any]:
        """Admit chat request `req`; open its stream (the Responses and
        Messages routes too).  A reasoning model's reasoning comes apart from
        its content (`reasoning_parser`)."""
        # The prompt, the grammar and the parser read one tool use.
        tools, text, ids = chat_ids(req, self.tokenizer, self.tool_format)
        check_reasoning(req, tools, self.cfg.reasoning_parser)
        users = [m.text() for m in req.messages if m.role == "user"]
        return await self._start(req, [PromptInput(ids, text)], chat=True,
                                 predict_texts=[users[-1] if users else text], tools=tools)

    # Plumbing -------------------------------------------------------------

    async def parse_body(self, request: Request, model: type) -> Any:
        self.metrics.ensure_running()
        # Bounded, strict JSON (api/http.py): a 4xx for every malformed body.
        return self.validate(await read_json_object(request, self.cfg.max_request_bytes),
                              model)

    def validate(self, data: dict[str, Any], model: type) -> Any:
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e)
        if req.model is not None and req.model not in self.model_routes.cards:
            raise unknown_model(req.model, list(self.model_routes.cards))
        return req

    async def _start(self, req: Any, prompts: list[PromptInput], chat: bool,
                     predict_texts: list[str], tools: ToolUse | None = None,
                     ) -> tuple[ResponseBuilder, Any]:
        """Admit the request and open its engine stream."""
        request_id = new_id("chatcmpl" if chat else "cmpl")
        gens = [generate_request(self, req, p, request_id if len(prompts) == 1
                                 else f"{request_id}-{i}", chat)
                for i, p in enumerate(prompts)]
        structure = await requested_structure(req, tools)
        for g in gens:
            g.admission_id, g.structured = request_id, structure
        check_prediction(gens[0])
        replica, call = await self._ahead.open(
            gens[0].job_class != JobClass.OFFLINE.value, lambda: self._admit(request_id, gens),
            lambda where, fresh: self._send(gens, where, fresh))
        stream = ResumableStream(
            gens, replica, call,
            lambda again, failed: self._resume(request_id, again, failed),
            move=lambda again, where: self._resume(request_id, again, where, moved=True))
        if self.predictor is not None:
            for g, text in zip(gens, predict_texts):
                self._predict(g.request_id, text, replica)
        # The predictor learns the base model's answers, not an adapter's.
        if (self.served_log is not None and not req.ignore_eos and not req.min_tokens
                and structure is None and gens[0].adapter is None):
            self._recording[request_id] = (predict_texts, req.stop_token_ids or [])
        logprobs = (req.logprobs if chat else req.logprobs is not None)
        builder = ResponseBuilder(request_id, req.model or self.cfg.model_name, now_s(),
                                  chat, prompts, req.n, self.token_text, logprobs=bool(logprobs),
                                  echo=bool(getattr(req, "echo", False)),
                                  prompt_logprobs=req.prompt_logprobs is not None,
                                  tools=tools, token_ids=req.return_token_ids,
                                  logprob_ids=req.return_tokens_as_token_ids,
                                  reasoning=reasoning_format(self.cfg.reasoning_parser))
        return builder, stream

    async def _respond(self, req: Any, started: tuple[ResponseBuilder, Any]) -> Response:
        builder, stream = started
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            builder.continuous_usage = include_usage and req.stream_options.continuous_usage_stats
            return StreamingResponse(self._sse(req, builder, stream, include_usage),
                                     media_type="text/event-stream")
        answer = await self.collect(builder, stream)
        if req.store:  # chat only: a completion's `store` is refused
            await self.chat_store.keep(req, answer)
        return JSONResponse(answer)

    async def _resume(self, request_id: str, gens: list[GenerateRequest],
                      failed: str | None, moved: bool = False) -> tuple[str | None, Any]:
        """Another replica for a request whose replica failed, or (`moved`)
        gave it back to the offline pool, and its stream (deployments/resume.py)."""
        replica = await (self._admit(request_id, gens, moved_from=failed or "") if moved
                         else self._admit(request_id, gens, failed_replica=failed or ""))
        return replica, self._send(gens, replica, False)

    def _send(self, gens: list[GenerateRequest], replica: str | None, fresh: bool) -> Any:
        """The request's engine stream on `replica` (DispatchAhead.open)."""
        def call() -> Any:
            return self.engine.generate.remote([g.model_dump() for g in gens], replica=replica)
        return contextvars.Context().run(call) if fresh else call()

    async def _admit(self, request_id: str, gens: list[GenerateRequest],
                     failed_replica: str | None = None,
                     moved_from: str | None = None) -> str | None:
        """Admission control (scheduler/admission.py): the whole request,
        all its prompts and choices, runs on one replica or gets a 429.
        With `failed_replica` (a request resumed after its replica failed),
        the Scheduler places it elsewhere without admission control."""
        resumed: dict[str, Any] = ({} if failed_replica is None
                                   else {"failed_replica": failed_replica})
        if moved_from is not None:
            resumed["moved_from"] = moved_from
        keys = prefix_keys(gens[0].prompt_token_ids, self.cfg.block_size, gens[0].cache_salt)
        if keys:  # where its leading blocks are likely cached
            resumed["prefix_keys"] = keys
            if gens[0].prompt_cache_key is not None:
                resumed["route_key"] = route_key(gens[0].prompt_cache_key)
        tokens, choices = sum(len(g.prompt_token_ids) for g in gens), len(gens) * gens[0].n
        try:
            if failed_replica is None and moved_from is None \
                    and gens[0].job_class != JobClass.OFFLINE.value:
                # One call with the online admissions arriving meanwhile.
                raw = await self._admits.submit(AdmitRequest(
                    request_id=request_id, prompt_tokens=tokens, max_tokens=gens[0].max_tokens,
                    job_class=gens[0].job_class, n=choices, priority=gens[0].priority,
                    **resumed).model_dump(exclude_defaults=True))
            else:
                # An offline request may wait in the offline pool, and would
                # hold up a batch; its door starts a few at a time anyway.
                raw = await self.scheduler.admit.remote(
                    request_id, tokens, gens[0].max_tokens, gens[0].job_class, choices,
                    priority=gens[0].priority, **resumed)
        except RayActorError as e:
            # The Scheduler replica died or restarted, with offline requests
            # waiting in its pool among others: retry.
            log.warning("request %s: the scheduler failed: %r", request_id, e)
            raise APIError(503, "the scheduler failed or restarted; retry",
                           type_="service_unavailable")
        adm = Admission.model_validate(raw)
        self._ahead.learn(adm)
        if not adm.admitted:
            retry = max(1, math.ceil(adm.retry_after_s or 1.0))
            raise APIError(429, adm.message or "the server is at capacity; retry later",
                           type_="rate_limit_error", headers={"Retry-After": str(retry)})
        return adm.replica

    def _predict(self, request_id: str, text: str, replica: str | None) -> None:
        """Ask for the response length beside the job, never before it
        (EconoServe §3.3.2): the job starts at once with an unknown length,
        and the engine learns the estimate whenever it lands."""
        from deployments.predictor import request_prediction

        task = request_prediction(self.predictor, text)

        def landed(t: "asyncio.Task[Any]") -> None:
            pred = None if t.cancelled() else t.result()
            if pred is not None:
                self._detached(lambda: self.engine_calls.set_prediction.remote(
                    request_id, pred["predicted_len"], replica=replica,
                    allocation=pred.get("allocation")))

        task.add_done_callback(landed)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _detached(self, make_call: Callable[[], Awaitable[Any]]) -> None:
        """Run `make_call()` (a handle call) outside the HTTP request's
        context.  Inside it, Serve would cancel the call when the client
        disconnects, and would give it the request's internal id, which
        the engine's stream already carries: Serve's request router indexes
        a pending call by that id, so a second call under the same id while
        the first is still being routed (a prediction landing before the
        engine replica is up) is never routed, and holds one of the
        router's routing tasks for good."""
        async def run() -> None:
            await make_call()

        task = asyncio.get_running_loop().create_task(run(), context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _release(self, request_id: str, outcome: str) -> None:
        """Tell the Scheduler the request ended, together with the requests
        ending meanwhile, from outside the HTTP request's context (the
        `Coalescer`'s calls run in a fresh one): a release cancelled with
        the request would leak the Scheduler's record of the job (8 % of
        requests in an overload run did)."""
        self._releases.submit((request_id, outcome))

    def _unwanted(self, req: dict[str, Any], raw: dict[str, Any]) -> None:
        """An admission whose client went away while it was asked for."""
        if raw.get("admitted"):
            self._release(req["request_id"], "aborted")

    async def _send_releases(self, releases: list[tuple[str, str]]) -> list[None]:
        try:
            await self.scheduler.release_many.remote(releases)
        except Exception as e:  # noqa: BLE001 - nobody awaits a release
            log.warning("releasing %d requests at the scheduler failed: %r", len(releases), e)
        return [None] * len(releases)

    def _finish(self, builder: ResponseBuilder, stream: Any, outcome: str) -> None:
        stream.cancel()
        self._release(builder.request_id, outcome)
        self.metrics.ended(builder.model, outcome, builder.usage())
        recording = self._recording.pop(builder.request_id, None)
        if recording is not None and outcome == "finished" and self.served_log is not None:
            try:
                texts, stop_ids = recording
                self.served_log.write(self.served_log.rows(texts, builder, stop_ids))
            except OSError as e:  # a full disk must not fail the request
                log.warning("could not record served completions: %r", e)

    async def collect(self, builder: ResponseBuilder, stream: Any) -> dict[str, Any]:
        outcome = "aborted"
        try:
            async for delta in engine_deltas(stream):
                builder.apply(delta, emit=False)
            outcome = "finished" if builder.done else "aborted"
        except EngineRefused as e:
            outcome = "error"
            raise APIError(400, str(e.__cause__))
        except EngineFailed as e:
            outcome = "error"
            log.warning("request %s failed in the engine: %r", builder.request_id, e.__cause__)
            raise engine_failure(e)
        finally:
            self._finish(builder, stream, outcome)
        return builder.response()

    async def _sse(self, req: Any, builder: ResponseBuilder, stream: Any,
                   include_usage: bool) -> AsyncIterator[str]:
        async with aclosing(self.chunks(builder, stream, include_usage)) as chunks:
            async for c in chunks:
                yield _event(c)
        if req.store and builder.done:  # kept before the client reads the end
            await self.chat_store.keep(req, builder.response())
        yield "data: [DONE]\n\n"

    async def chunks(self, builder: ResponseBuilder, stream: Any,
                     include_usage: bool = False) -> AsyncIterator[dict[str, Any]]:
        """A streamed answer's chunks; if it fails once started (status 200
        sent), an error body last, so the stream still ends and no client
        hangs.  The request is released when they end or are closed."""
        outcome = "aborted"
        try:
            for c in builder.opening_chunks():
                yield c
            async for delta in engine_deltas(stream):
                for c in builder.apply(delta):
                    yield c
            if include_usage:
                yield builder.usage_chunk()
            outcome = "finished" if builder.done else "aborted"
        except Exception as e:
            outcome = "error"
            if isinstance(e, EngineRefused):
                err = APIError(400, str(e.__cause__))
            elif isinstance(e, EngineFailed):
                log.warning("stream %s failed in the engine: %r", builder.request_id,
                            e.__cause__)
                err = engine_failure(e)
            else:
                log.exception("stream %s failed", builder.request_id)
                err = APIError(500, "internal server error")
            yield err.body()
        finally:
            self._finish(builder, stream, outcome)


def _app_name() -> str:
    """The Serve application this ingress serves: the one its batches'
    jobs send their requests to."""
    return serve.get_replica_context().app_name


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
