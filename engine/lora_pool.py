"""The LoRA adapters a runner serves: those of `lora_adapters`, loaded at
start and kept, and those loaded while the application runs
(`lora_runtime`), read from their folder when a request first names them.

A runtime adapter comes with its request: its name, folder and the time it
was loaded (`SamplingParams.adapter_path`, `adapter_loaded_at`), which the
Ingress looked up in the registry of loaded adapters
(deployments/lora_registry.py).  So every engine replica serves it with no
message of its own, a replica started later reads it on first use, and an
adapter loaded again under its name (another folder, or the same folder
rewritten, `load_inplace`) is a new version that replaces the old one.  At
most `max_loaded` runtime adapters are kept, the least recently named
dropped first; a request holds its adapter (`RequestState.lora`) until it
ends, so dropping one never changes a running request, and an adapter
unloaded from the registry stops being named but finishes its requests.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from engine.lora import Adapter, load_adapter
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.models.base import CausalLM


class AdapterPool:
    def __init__(self, model: CausalLM, static: dict[str, Adapter], max_loaded: int = 8
                 ) -> None:
        self.model = model
        self.static = static
        self.max_loaded = max_loaded
        # (name, folder, loaded_at) -> adapter, least recently named first.
        self.runtime: OrderedDict[tuple[str, str, float], Adapter] = OrderedDict()
        self.num_loads = 0

    def acquire(self, params: SamplingParams) -> Adapter | None:
        """The adapter `params` runs with (None: the base model); a
        ValueError (`AdapterError` for one that cannot be served) naming it."""
        name = params.adapter
        if name is None:
            return None
        if params.adapter_path is None:
            adapter = self.static.get(name)
            if adapter is None:
                raise ValueError(f"no LoRA adapter {name!r} is loaded "
                                 f"(loaded: {sorted(self.static)})")
            return adapter
        key = (name, params.adapter_path, params.adapter_loaded_at or 0.0)
        adapter = self.runtime.get(key)
        if adapter is not None:
            self.runtime.move_to_end(key)
            return adapter
        # Read here, in the engine loop's thread, between passes: tens of
        # milliseconds for a rank-8 adapter of a small model.
        with torch.no_grad():
            adapter = load_adapter(name, params.adapter_path, self.model)
        self.num_loads += 1
        for old in [k for k in self.runtime if k[0] == name]:
            del self.runtime[old]  # an older version of the name
        self.runtime[key] = adapter
        while len(self.runtime) > self.max_loaded:
            self.runtime.popitem(last=False)
        return adapter

    def names(self) -> list[str]:
        return sorted({*self.static, *(k[0] for k in self.runtime)})
