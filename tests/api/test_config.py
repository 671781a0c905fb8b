"""Application config: a bad predictor placement fails at start with the field named."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from api.config import AppConfig


def test_predictor_runs_on_cpu_by_default() -> None:
    p = AppConfig().predictor
    assert (p.device, p.num_gpus) == ("cpu", 0.0)


def test_predictor_on_cuda_takes_a_gpu_share() -> None:
    p = AppConfig(predictor={"enabled": True, "device": "cuda", "num_gpus": 0.1}).predictor
    assert (p.device, p.num_gpus) == ("cuda", 0.1)
    with pytest.raises(ValidationError, match=r"predictor\.num_gpus: must be > 0"):
        AppConfig(predictor={"enabled": True, "device": "cuda"})
    with pytest.raises(ValidationError, match=r"predictor\.num_gpus: a GPU share needs"):
        AppConfig(predictor={"num_gpus": 0.5})
    with pytest.raises(ValidationError, match="device"):
        AppConfig(predictor={"device": "tpu"})
