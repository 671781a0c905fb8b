"""The `lora_runtime` settings of the application config (api/config.py)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LoraRuntimeSettings(BaseModel):
    """Adapters loaded and unloaded while the application runs (vLLM's
    `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`,
    deployments/lora_routes.py), beside the `lora_adapters` loaded at start."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Off by default: the routes then answer 404, as vLLM's do without
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING.
    enabled: bool = False
    # The folder a client's `lora_path` names a folder within (relative to
    # it, or absolute inside it): nothing outside it is read.  Required
    # when enabled; on every node's filesystem.
    root: str | None = None
    # Runtime adapters an engine replica keeps in memory; past this, the
    # least recently used one that no request runs is dropped (and read
    # again from its folder when a request names it).
    max_loaded: int = Field(8, ge=1, le=1024)
    # Where the loaded adapters are listed (deployments/lora_registry.py):
    # every Ingress replica reads and writes it, so on a multi-node cluster
    # a filesystem every node mounts at this path.  None: `lora/` under the
    # cache directory ($PREEMPT_SERVE_CACHE, else $XDG_CACHE_HOME/preempt-serve,
    # else ~/.cache/preempt-serve).
    storage_dir: str | None = None

    @model_validator(mode="after")
    def _root_when_enabled(self) -> "LoraRuntimeSettings":
        if self.enabled and not self.root:
            raise ValueError("root: required with enabled: true (the folder clients' "
                             "lora_path names a folder within)")
        if self.root and not Path(self.root).expanduser().is_dir():
            raise ValueError(f"root: {self.root!r} is not a folder")
        return self

    def storage_path(self) -> Path:
        from engine.model_source import cache_root

        if self.storage_dir:
            return Path(self.storage_dir).expanduser()
        return cache_root() / "lora"
