"""`GET /v1/models` and `GET /v1/models/{model}`, as OpenAI serves them.

One model per application.  Its `created` is when the ingress started, so
the object is the same on every call (OpenAI's is the model's creation
time, not the request's).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.errors import APIError
from api.protocol import now_s


class ModelRoutes:
    """The routes for the one model `name` an application serves."""

    def __init__(self, name: str, max_model_len: int) -> None:
        self.card: dict[str, Any] = {
            "id": name,
            "object": "model",
            "created": now_s(),
            "owned_by": "preempt-serve",
            "max_model_len": max_model_len,
        }

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.list, methods=["GET"]),
            # `{model:path}`: a model id may hold slashes (`org/name`).
            Route("/v1/models/{model:path}", self.retrieve, methods=["GET"]),
        ]

    async def list(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.card]})

    async def retrieve(self, request: Request) -> Response:
        model = request.path_params["model"]
        if model != self.card["id"]:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                           f"{self.card['id']!r}", "model", "model_not_found")
        return JSONResponse(self.card)
