"""The response-length predictor's settings (`predictor:` in the config)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class PredictorSettings(BaseModel):
    """The response-length predictor beside the engines (EconoServe §3.3.2)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    # A trained adapter folder; None: the one shipped in predictor/adapters.
    adapter: str | None = None
    padding_ratio: float = Field(0.15, ge=0.0, le=4.0)
    num_cpus: float = Field(1.0, gt=0)
    # "cuda" runs the predictor on a GPU share of `num_gpus` (e.g. 0.1 beside
    # the engines): the adapter trained on 1,024-token prompts over all 30
    # layers (studies/predictor/smollm2-sharegpt-long, in the repository only)
    # costs seconds per prediction on a CPU core and milliseconds on a GPU.
    device: Literal["cpu", "cuda"] = "cpu"
    num_gpus: float = Field(0.0, ge=0)
    # A folder where each Ingress replica appends the completions it served
    # (deployments/served_log.py), for `python -m predictor retrain`.
    # None: nothing is recorded.
    record_dir: str | None = None
    # The engine's length head (engine/length_head.py): each job's answer
    # length estimated from the served model's own final hidden state at
    # its prompt's last position, when it samples its first token; it
    # replaces the predictor's estimate from then on (or is the only one,
    # with `enabled: false`: no second model).  `embedded`: the head
    # fitted on the embedded model's answers; or a file written by
    # `python -m predictor fit-head`.  None: no head.
    engine_head: str | None = None

    @field_validator("engine_head")
    @classmethod
    def _head_file(cls, v: str | None) -> str | None:
        if v is not None and v != "embedded" and not Path(v).is_file():
            raise ValueError(f"no such file: {v!r} (a file written by "
                             "`python -m predictor fit-head`, or `embedded`)")
        return v

    @model_validator(mode="after")
    def _gpu_share_for_cuda(self) -> "PredictorSettings":
        if self.device == "cuda" and self.num_gpus <= 0:
            raise ValueError("predictor.num_gpus: must be > 0 with predictor.device 'cuda' "
                             "(the GPU share Ray reserves for each predictor replica)")
        if self.device == "cpu" and self.num_gpus > 0:
            raise ValueError("predictor.num_gpus: a GPU share needs predictor.device 'cuda'")
        return self
