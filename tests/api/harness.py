"""The real Ingress ASGI app in process, without Ray.

`Harness` instantiates the undecorated `Ingress` class with fake Serve
handles and drives its Starlette app with Starlette's TestClient.  The fakes
answer in the shapes the real deployments do:

- scheduler: `admit.remote(request_id, prompt_tokens, max_tokens,
  job_class, n, priority=..., prefix_keys=...)` awaits to an `Admission` dict (admitted, or refused with
  `retry_after_s` for a 429 when `reject` is set); `release.remote(
  request_id, outcome)` awaits to None; `admit_many` and `release_many`
  call them for each request in turn, as the Scheduler does.
- batch jobs (`ingress.batches.jobs`, batch/jobs.py's `Jobs`): `FakeJobs`,
  which records submissions and answers with the state a test sets; files
  and batch records go to a temporary storage directory.
- engine: `.options(stream=True).generate.remote(requests, replica=...)`
  (one `GenerateRequest` dump per prompt of the client's request) returns
  an async iterator with `cancel()` that yields lists of `GenerateDelta`
  dumps, one per choice with new output (its `prompt` and `index`), the
  last delta of each choice carrying its `finish_reason` and `JobMetrics`
  (a canned answer ends at its first stop string, as the engine's would,
  with the `stop_reason`);
  `set_prediction.remote(...)` awaits to None. A view made by `options()`
  keeps the options it was made from (`_by_reference=False` included), as
  a Serve handle's does.

The tokenizer is the real one (`embedded:smollm2`), so prompts, chat
templates and token ids go through the code a server runs.
"""

from __future__ import annotations

import asyncio

import os
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.testclient import TestClient

from api.config import API_KEY_ENV
from api.protocol import GenerateDelta, GenerateRequest, JobMetrics, WireLogprob
from tests.batch.fakes import FakeJobs

# What every fake choice "generates", cycled to the token count it needs.
_OUTPUT_TEXT = " The quick brown fox jumps over the lazy dog."


class _Method:
    """`handle.method` of a fake handle: `.remote(...)` calls `fn`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


async def settle_until(until: Callable[[], bool], what: str) -> None:
    """Wait (at most 5 s, on the running loop) until `until()` holds."""
    for _ in range(500):
        if until():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def admit_each(scheduler: Any) -> _Method:
    """`admit_many` as the Scheduler answers it: `scheduler.admit` for each
    request in turn (a test that replaces `admit` sees every admission)."""
    async def admit_many(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [await scheduler.admit.remote(**r) for r in requests]

    return _Method(admit_many)


def release_each(scheduler: Any) -> _Method:
    """`release_many`: `scheduler.release` for each (request id, outcome)."""
    async def release_many(releases: list[tuple[str, str]]) -> None:
        for request_id, outcome in releases:
            await scheduler.release.remote(request_id, outcome)

    return _Method(release_many)


@dataclass
class FakeScheduler:
    reject: bool = False
    admitted: list[tuple[str, int, int, str, int]] = field(default_factory=list)
    released: dict[str, str] = field(default_factory=dict)
    # The prompt's block keys each admitted request came with.
    prefix_keys: dict[str, list[int] | None] = field(default_factory=dict)
    # The routing key (`prompt_cache_key`) each admitted request came with.
    route_keys: dict[str, int | None] = field(default_factory=dict)
    # Engine replicas reporting their load (what /health reads); None: the
    # scheduler does not answer.
    live_engines: int | None = 1
    # False once the ingress asked for calls by value (deployments/handles.py).
    by_reference: bool = True
    # The replica every admission answer names, and names for the next
    # request to be sent to ahead of its answer (deployments/dispatch_ahead.py).
    ahead: str | None = None

    def __post_init__(self) -> None:
        self.admit = _Method(self._admit)
        self.release = _Method(self._release)
        self.ready = _Method(self._ready)
        self.admit_many = admit_each(self)
        self.release_many = release_each(self)

    def options(self, _by_reference: bool = True) -> "FakeScheduler":
        # One state for the handle and its view, as the tests read it.
        self.by_reference = _by_reference
        return self

    async def _ready(self) -> dict[str, int]:
        if self.live_engines is None:
            raise asyncio.TimeoutError
        return {"live_engines": self.live_engines, "engines": 1}

    async def _admit(self, request_id: str, prompt_tokens: int, max_tokens: int,
                     job_class: str = "online", n: int = 1, priority: int = 0,
                     prefix_keys: list[int] | None = None,
                     route_key: int | None = None) -> dict[str, Any]:
        if self.reject:
            return {"admitted": False, "retry_after_s": 2.0,
                    "message": "the server is at capacity; retry in 2 s"}
        self.admitted.append((request_id, prompt_tokens, max_tokens, job_class, n))
        self.prefix_keys[request_id] = prefix_keys
        self.route_keys[request_id] = route_key
        return {"admitted": True, "replica": self.ahead, "dispatch_ahead": self.ahead}

    async def _release(self, request_id: str, outcome: str) -> None:
        self.released[request_id] = outcome


class FakeStream:
    """What `generate.remote` returns on a streaming handle."""

    def __init__(self, items: list[list[dict[str, Any]]], state: "_EngineState | None" = None
                 ) -> None:
        self._items = items
        self._state = state
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __aiter__(self) -> AsyncIterator[list[dict[str, Any]]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[list[dict[str, Any]]]:
        for k, item in enumerate(self._items):
            while (self._state is not None and self._state.paused
                   and k >= self._state.free_wakeups and not self.cancelled):
                await asyncio.sleep(0.005)  # an engine busy elsewhere
            if self.cancelled:
                return
            yield item


@dataclass
class _EngineState:
    """Shared by a handle and the views `options()` makes of it."""

    tokenizer: Any = None
    # Every request the ingress sent, validated as the real engine does.
    requests: list[GenerateRequest] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)
    # What every choice answers instead (whole, then ends with "stop"),
    # one token per engine wake-up: a test of how answers are read sets it.
    answer: str | None = None
    # While true, every stream waits before its next wake-up (after its
    # first `free_wakeups`).
    paused: bool = False
    free_wakeups: int = 0
    # Per `generate` call: whether it went on a by-reference view.
    generate_by_reference: list[bool] = field(default_factory=list)


class FakeEngine:
    def __init__(self, state: _EngineState | None = None, stream: bool = False,
                 by_reference: bool = True) -> None:
        self.state = state or _EngineState()
        self.stream = stream
        # A view keeps the options it was made with, as a Serve handle's does.
        self.by_reference = by_reference
        self.generate = _Method(self._generate)
        self.set_prediction = _Method(self._set_prediction)
        self.check_lora = _Method(self._check_lora)

    @property
    def requests(self) -> list[GenerateRequest]:
        return self.state.requests

    @property
    def streams(self) -> list[FakeStream]:
        return self.state.streams

    def options(self, stream: bool | None = None,
                _by_reference: bool | None = None) -> "FakeEngine":
        return FakeEngine(self.state, self.stream if stream is None else stream,
                          self.by_reference if _by_reference is None else _by_reference)

    async def _check_lora(self, name: str, path: str) -> str | None:
        """The real engine reads the adapter onto its model; this one has
        none: the folder's settings only (engine/lora.py's own check)."""
        from pathlib import Path

        from engine.lora import AdapterError, _config

        try:
            _config(name, Path(path))
        except AdapterError as e:
            return str(e)
        return None

    async def _set_prediction(self, request_id: str, predicted_len: int,
                              replica: str | None = None, allocation: int | None = None) -> None:
        return None

    def _generate(self, requests: list[dict[str, Any]], replica: str | None = None
                  ) -> FakeStream:
        assert self.stream, "generate is only called on the stream=True handle"
        reqs = [GenerateRequest(**r) for r in requests]  # raises as the real engine would
        self.requests.extend(reqs)
        self.state.generate_by_reference.append(self.by_reference)
        per_prompt = [self._deltas(p, req) for p, req in enumerate(reqs)]
        # The prompts' wake-ups interleave, as their jobs share iterations.
        items = [sum((d[k] for d in per_prompt if k < len(d)), [])
                 for k in range(max(len(d) for d in per_prompt))]
        stream = FakeStream(items, self.state)
        self.streams.append(stream)
        return stream

    def _logprob(self, token: int, k: int) -> dict[str, Any]:
        top = [(token, -0.25)] + [((token + j) % 1000, -1.0 - j) for j in range(1, k)]
        return WireLogprob(logprob=-0.25, top=top[:k]).model_dump()

    def _deltas(self, prompt: int, req: GenerateRequest) -> list[list[dict[str, Any]]]:
        tok = self.state.tokenizer
        answer = self.state.answer
        output = tok(answer or _OUTPUT_TEXT, add_special_tokens=False)["input_ids"]
        count = min(req.max_tokens, len(output) if answer is not None
                    else max(3, min(req.min_tokens, 16)))
        finish = "stop" if answer is not None and count == len(output) \
            else "length" if count == req.max_tokens else "stop"
        tokens = [output[i % len(output)] for i in range(count)]
        pieces = [tok.decode([t]) for t in tokens]
        stop_reason: str | None = None
        if answer is not None and req.stop:
            # As the engine's detokenizer: the first stop string ends the
            # answer (kept only with include_stop_str_in_output) and no
            # part of it is sent before it matches.
            text = ""
            for k, piece in enumerate(pieces):
                text += piece
                hits = [(text.find(s), s) for s in req.stop if s in text]
                if hits:
                    at, stop_reason = min(hits)
                    visible = text[:at] + (stop_reason if req.include_stop_str_in_output
                                           else "")
                    tokens, count, finish = tokens[:k + 1], k + 1, "stop"
                    sent = 0
                    for j in range(count):
                        end = len(visible) if j == k else min(
                            len(visible), sent + len(pieces[j]))
                        pieces[j], sent = visible[sent:end], end
                    break
        metrics = JobMetrics(queue_time=0.001, ttft=0.01, e2e=0.02, execution_time=0.015,
                             swap_wait_time=0.0, num_preemptions=0).model_dump()
        if req.prediction_token_ids is not None:
            # As if every output token but the first had been a prediction
            # draft, accepted, and one refused.
            metrics.update(accepted_prediction_tokens=max(0, count - 1),
                           rejected_prediction_tokens=1)

        def delta(index: int, ids: list[int], first: bool, last: bool,
                  text: str | None = None) -> dict[str, Any]:
            d = GenerateDelta(prompt=prompt, index=index, token_ids=ids,
                              text="".join(tok.decode([t]) for t in ids) if text is None
                              else text)
            if req.logprobs is not None:
                d.logprobs = [WireLogprob.model_validate(self._logprob(t, req.logprobs))
                              for t in ids]
            if first and req.prompt_logprobs is not None:
                d.prompt_logprobs = [None] + [
                    WireLogprob.model_validate(self._logprob(t, req.prompt_logprobs))
                    for t in req.prompt_token_ids[1:]]
            if last:
                d.finish_reason, d.metrics = finish, JobMetrics.model_validate(metrics)
                d.stop_reason = stop_reason
            return d.model_dump()

        if answer is not None:
            return [[delta(i, tokens[k:k + 1], k == 0, k == count - 1, pieces[k])
                     for i in range(req.n)] for k in range(count)]
        # One engine wake-up with every choice's first token, one with the rest.
        first = [delta(i, tokens[:1], True, count == 1) for i in range(req.n)]
        if count == 1:
            return [first]
        return [first, [delta(i, tokens[1:], False, True) for i in range(req.n)]]


def undecorated_ingress() -> type:
    """The user class under Serve's `@serve.deployment` and `@serve.ingress`."""
    from deployments.ingress import Ingress

    wrapper = Ingress.func_or_class
    return next(c for c in wrapper.__mro__ if "__serve_build_asgi_app__" in vars(c))


@contextmanager
def _no_env_key() -> Iterator[None]:
    saved = os.environ.pop(API_KEY_ENV, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[API_KEY_ENV] = saved


@dataclass
class Harness:
    ingress: Any
    app: Starlette
    client: TestClient
    scheduler: FakeScheduler
    engine: FakeEngine
    model_name: str
    jobs: FakeJobs


@contextmanager
def harness(api_key: str | None = None, max_request_bytes: int = 64 * 1024,
            **config: Any) -> Iterator[Harness]:
    """A started ingress app; `api_key` None means no authentication, whatever
    the environment holds."""
    from api.config import AppConfig

    with tempfile.TemporaryDirectory(prefix="batches-") as storage:
        cfg = {"model": "embedded:smollm2", "max_request_bytes": max_request_bytes,
               "api_key": api_key, "batch": {"storage_dir": storage},
               "responses": {"storage_dir": f"{storage}/responses"}, **config}
        with _no_env_key():
            AppConfig(**cfg)  # a bad harness config fails here, not in the ingress
            scheduler = FakeScheduler()
            engine = FakeEngine()
            ingress = undecorated_ingress()(cfg, scheduler, engine)
        # The engine detokenizes with the model's tokenizer, as the real one does.
        engine.state.tokenizer = ingress.tokenizer
        jobs = FakeJobs()
        ingress.batches.jobs = jobs
        ingress.batch_routes.app = lambda: "test-app"
        app = ingress.__serve_build_asgi_app__()
        # Exceptions after a response started re-raise in the test: a stream
        # that breaks mid-way fails loudly instead of looking merely short.
        with TestClient(app, raise_server_exceptions=True) as client:
            yield Harness(ingress, app, client, scheduler, engine, ingress.cfg.model_name,
                          jobs)
