"""The bodies of vLLM's runtime LoRA routes (`POST /v1/load_lora_adapter`,
`POST /v1/unload_lora_adapter`, deployments/lora_routes.py), where a
client's folder may lie, and their part of `GET /openapi.json`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.config import ADAPTER_NAME
from api.errors import APIError
from api.openapi_ops import post_op


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _adapter_name(v: str) -> str:
    if not ADAPTER_NAME.fullmatch(v):
        raise ValueError("an adapter's name is 1-128 letters, digits and . _ - : / "
                         "(clients send it as `model`)")
    return v


class LoadLoraAdapterRequest(_Strict):
    lora_name: str
    # A PEFT LoRA folder inside `lora_runtime.root` (relative to it, or absolute).
    lora_path: str = Field(..., min_length=1, max_length=4096)
    # vLLM's: replace an adapter already loaded under the name (its folder
    # rewritten, or another); its running requests finish on the old weights.
    load_inplace: bool = False

    _name = field_validator("lora_name")(_adapter_name)


class UnloadLoraAdapterRequest(_Strict):
    lora_name: str

    _name = field_validator("lora_name")(_adapter_name)


def folder_within(root: Path, path: str) -> Path:
    """The adapter folder `path` names inside `root`, links resolved; a 400
    naming `lora_path` for one outside it or without `adapter_config.json`."""
    folder = (root / Path(path).expanduser()).resolve()
    if folder != root and root not in folder.parents:
        raise APIError(400, f"lora_path {path[:300]!r} is outside the folder adapters are "
                       "loaded from (lora_runtime.root)", "lora_path")
    if not (folder / "adapter_config.json").is_file():
        raise APIError(400, f"no adapter_config.json in lora_path {path[:300]!r} (a PEFT "
                       "LoRA adapter's folder)", "lora_path")
    return folder


MODELS: list[tuple[type[BaseModel], Any]] = [
    (LoadLoraAdapterRequest, "validation"),
    (UnloadLoraAdapterRequest, "validation"),
]

_TEXT = {"type": "string"}
_ERRORS = {
    "400": "a field is invalid, the folder is outside lora_runtime.root or not a LoRA "
           "adapter this model can serve, or the name is taken (load) or fixed (unload)",
    "401": "the API key is missing or wrong (when the server requires one)",
    "404": "no adapter of that name was loaded at runtime (unload)",
    "413": "the body is larger than the server's limit",
    "415": "the Content-Type is not JSON",
    "500": "an internal error",
}


def lora_paths(refs: dict[Any, dict[str, Any]], error_ref: dict[str, Any]) -> dict[str, Any]:
    def op(summary: str, body: dict[str, Any]) -> dict[str, Any]:
        return post_op(summary, body, _TEXT, _ERRORS, error_ref, "text/plain")

    return {
        "/v1/load_lora_adapter": {"post": op(
            "Serve a LoRA adapter under a name, from a folder inside lora_runtime.root",
            refs[(LoadLoraAdapterRequest, "validation")])},
        "/v1/unload_lora_adapter": {"post": op(
            "Stop serving a LoRA adapter loaded at runtime",
            refs[(UnloadLoraAdapterRequest, "validation")])},
    }
