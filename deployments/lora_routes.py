"""LoRA adapters loaded and unloaded while the application runs: vLLM's
`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, served
with `lora_runtime.enabled`.

A load checks the folder (inside `lora_runtime.root`, a PEFT LoRA adapter
of this model: an engine replica reads it aside, `Engine.check_lora`) and
lists it in the registry every Ingress replica reads
(deployments/lora_registry.py); from then on any Ingress replica serves the
name as a `model` and sends its folder with each request, and each engine
replica reads the adapter on its first request (engine/lora_pool.py).  An
unload takes the name off the list: new requests naming it get a 404, the
running ones finish with it.  The adapters of `lora_adapters` are fixed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from api.config import AppConfig
from api.errors import APIError
from api.http import read_model
from api.lora_runtime import LoadLoraAdapterRequest, UnloadLoraAdapterRequest, folder_within
from deployments.lora_registry import LoraRegistry, RuntimeAdapter

# (name, folder) -> why the engine cannot serve it, or None.
Check = Callable[[str, str], Awaitable[str | None]]


class LoraRoutes:
    def __init__(self, cfg: AppConfig, check: Check) -> None:
        settings = cfg.lora_runtime
        self.enabled = settings.enabled
        self.registry = LoraRegistry(settings.storage_path()) if self.enabled else None
        self.root = Path(settings.root or ".").expanduser().resolve()
        self.fixed = {cfg.model_name, *cfg.lora_adapters}
        self.check = check
        self.max_request_bytes = cfg.max_request_bytes

    def routes(self) -> list[Route]:
        if not self.enabled:
            return []
        return [Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload, methods=["POST"])]

    def loaded(self) -> dict[str, RuntimeAdapter]:
        """The adapters loaded at runtime, by name (the fixed names win)."""
        if self.registry is None:
            return {}
        entries = self.registry.entries()
        if not self.fixed.isdisjoint(entries):
            entries = {k: v for k, v in entries.items() if k not in self.fixed}
        return entries

    def folders(self) -> dict[str, str]:
        return {name: a.path for name, a in self.loaded().items()}

    async def load(self, request: Request) -> Response:
        req = await read_model(request, LoadLoraAdapterRequest, self.max_request_bytes)
        assert self.registry is not None
        name = req.lora_name
        self._not_fixed(name)
        folder = folder_within(self.root, req.lora_path)
        if name in self.loaded() and not req.load_inplace:
            raise _taken(name)
        why = await self.check(name, str(folder))
        if why is not None:
            raise APIError(400, why, "lora_path")
        if self.registry.add(name, str(folder), replace=req.load_inplace) is None:
            raise _taken(name)  # loaded meanwhile, by another request
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        req = await read_model(request, UnloadLoraAdapterRequest, self.max_request_bytes)
        assert self.registry is not None
        self._not_fixed(req.lora_name)
        if not self.registry.remove(req.lora_name):
            raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.",
                           "lora_name", "model_not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed "
                                 "successfully.")

    def _not_fixed(self, name: str) -> None:
        if name in self.fixed:
            raise APIError(400, f"{name!r} is the served model or an adapter of "
                           "lora_adapters, loaded at start: it cannot be loaded or unloaded "
                           "at runtime", "lora_name")


def _taken(name: str) -> APIError:
    return APIError(400, f"The lora adapter '{name}' has already been loaded (send "
                    "load_inplace: true to replace it).", "lora_name")
