"""`GET /v1/models` and `GET /v1/models/{model}`, as OpenAI serves them.

One model per application, and the LoRA adapters it serves: those loaded
at start and those loaded while it runs (`runtime`, read on every call).  Its
`created` is when the ingress started, so the object is the same on every
call (OpenAI's is the model's creation time, not the request's).  A request
with Anthropic's `anthropic-version` header (its clients send one with
every call) gets Anthropic's shapes: `{"type": "model", "id",
"display_name", "created_at", "max_input_tokens"}` (the model's
`max_model_len`) and a page with `has_more`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.errors import APIError
from api.messages_api import iso_utc
from api.protocol import now_s


class ModelRoutes:
    """The routes for the model `name` an application serves, and its LoRA
    `adapters` (name -> folder), listed after it with it as their `parent`
    and their folder as their `root`, as vLLM lists them."""

    def __init__(self, name: str, max_model_len: int,
                 adapters: dict[str, str] | None = None,
                 runtime: Callable[[], dict[str, str]] | None = None) -> None:
        self.card: dict[str, Any] = {
            "id": name,
            "object": "model",
            "created": now_s(),
            "owned_by": "preempt-serve",
            "max_model_len": max_model_len,
        }
        self.fixed = {name: self.card, **{
            adapter: self._adapter_card(adapter, path) for adapter, path in
            (adapters or {}).items()}}
        self.runtime = runtime

    @property
    def cards(self) -> dict[str, dict[str, Any]]:
        """Every served model's card, by id: the model, then its adapters."""
        loaded = self.runtime() if self.runtime is not None else None
        if not loaded:
            return self.fixed
        return {**self.fixed, **{a: self._adapter_card(a, p) for a, p in loaded.items()
                                 if a not in self.fixed}}

    def _adapter_card(self, adapter: str, path: str) -> dict[str, Any]:
        return {**self.card, "id": adapter, "parent": self.card["id"], "root": path}

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.list, methods=["GET"]),
            # `{model:path}`: a model id may hold slashes (`org/name`).
            Route("/v1/models/{model:path}", self.retrieve, methods=["GET"]),
        ]

    async def list(self, request: Request) -> Response:
        if _anthropic(request):
            data = [_anthropic_card(c) for c in self.cards.values()]
            return JSONResponse({"data": data, "has_more": False, "first_id": data[0]["id"],
                                 "last_id": data[-1]["id"]})
        return JSONResponse({"object": "list", "data": list(self.cards.values())})

    async def retrieve(self, request: Request) -> Response:
        model = request.path_params["model"]
        if model not in self.cards:
            raise unknown_model(model, list(self.cards))
        card = self.cards[model]
        return JSONResponse(_anthropic_card(card) if _anthropic(request) else card)


def _anthropic(request: Request) -> bool:
    return "anthropic-version" in request.headers


def _anthropic_card(card: dict[str, Any]) -> dict[str, Any]:
    return {"type": "model", "id": card["id"], "display_name": card["id"],
            "created_at": iso_utc(card["created"]),
            "max_input_tokens": card["max_model_len"]}


def unknown_model(model: str, served: list[str]) -> APIError:
    """The 404 for a `model` not served."""
    names = ", ".join(repr(n) for n in served[:20])
    return APIError(404, f"model {model[:200]!r} does not exist; this server serves "
                    f"{names}", "model", "model_not_found")
