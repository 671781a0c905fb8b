"""Checkpoint loading: names map to our parameters, and mistakes fail loudly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models import model_class
from engine.models.base import WeightLoadError
from engine.weights import WeightsNotFound, iter_weights


def _model(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    return model_class(config.model_type)(config, torch.float32, torch.device("cpu"), 64)


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_opt350_path"])
def test_loads_every_parameter(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    model = _model(path)
    ckpt = dict(iter_weights(path))
    model.load_weights(ckpt.items())
    # Fused q|k|v rows hold the three projections in order.
    q = next(v for k, v in ckpt.items() if k.endswith("layers.1.self_attn.q_proj.weight"))
    assert torch.equal(model.layers[1].qkv[: q.shape[0]], q)


def test_opt_original_names_without_model_prefix(tiny_opt_path: Path) -> None:
    model = _model(tiny_opt_path)
    ckpt = {k.removeprefix("model."): v for k, v in iter_weights(tiny_opt_path)}
    model.load_weights(ckpt.items())


def test_unknown_and_missing_tensors_fail(tiny_llama_path: Path) -> None:
    ckpt = dict(iter_weights(tiny_llama_path))
    with pytest.raises(WeightLoadError, match="unexpected Llama checkpoint tensor"):
        extra = ("model.extra.weight", torch.zeros(1))
        _model(tiny_llama_path).load_weights([*ckpt.items(), extra])
    partial = {k: v for k, v in ckpt.items() if "layers.0.self_attn.k_proj" not in k}
    with pytest.raises(WeightLoadError, match=r"lacks weights for \['layers.0.qkv'\]"):
        _model(tiny_llama_path).load_weights(partial.items())
    bad = dict(ckpt, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(WeightLoadError, match="does not fit"):
        _model(tiny_llama_path).load_weights(bad.items())


def test_unsupported_model_type_and_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        model_class("gpt2")
    with pytest.raises(WeightsNotFound):
        list(iter_weights(tmp_path))
