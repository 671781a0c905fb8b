"""Model registry: our model class for a Hugging Face `config.model_type`."""

from __future__ import annotations

from engine.models.base import CausalLM, ForwardBatch
from engine.models.llama import LlamaForCausalLM
from engine.models.opt import OPTForCausalLM

MODELS: dict[str, type[CausalLM]] = {
    cls.model_type: cls for cls in (LlamaForCausalLM, OPTForCausalLM)
}


def model_class(model_type: str) -> type[CausalLM]:
    try:
        return MODELS[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {sorted(MODELS)}"
        ) from None


__all__ = ["MODELS", "CausalLM", "ForwardBatch", "model_class"]
