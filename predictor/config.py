"""Configuration of the response-length (RL) predictor: data, model, training.

Every knob that changes what a trained adapter means (backbone, depth, prompt
truncation, head kind) lives in `ModelConfig` and is saved next to the adapter,
so an adapter is always loaded with the exact preprocessing it was trained on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_BACKBONE = "embedded:smollm2"

# KV blocks are 32 tokens in EconoServe's setup (§2, "the block size was set to
# 32"), so the bucket head uses 32-token bins: a bin is one KV block.
DEFAULT_BIN_WIDTH = 32


def cache_dir() -> Path:
    """Where built datasets, prefix caches and run checkpoints go (never the repo)."""
    from engine.model_source import cache_root

    base = os.environ.get("PREDICTOR_CACHE")
    return Path(base) if base else cache_root() / "predictor"


class DatasetConfig(BaseModel):
    """How ShareGPT pairs are built and split (EconoServe §2.3)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The served model's tokenizer defines what "length" means: the KV cache
    # holds that model's tokens.
    tokenizer: str = DEFAULT_BACKBONE
    # EconoServe §2.3: "10K requests ... for fine-tuning; 70% of the data for
    # training and 30% for testing. All other remaining requests ... were used
    # in our experiments."
    n_finetune: int = 10_000
    test_fraction: float = 0.3
    seed: int = 0
    # EconoServe Table 2 lists ShareGPT outputs of 19..991 tokens (OPT's context
    # is 2048): answers longer than `max_response_tokens` are outside what the
    # served model can produce and are dropped, as are degenerate ones.
    min_response_tokens: int = 4
    max_response_tokens: int = 1024


class ModelConfig(BaseModel):
    """Backbone + LoRA + head. Saved as `predictor_config.json` with the adapter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backbone: str = DEFAULT_BACKBONE  # "embedded:<name>" or a local HF folder
    # Keep only the first `depth` decoder layers (None = all). On a CPU budget
    # the lower/middle layers carry most of what a length probe needs and each
    # dropped layer is saved on every prediction.
    depth: int | None = None
    # LoRA on the attention projections of the top `lora_layers` kept layers
    # (None = all). Layers below stay frozen, so their outputs can be cached
    # once per dataset (predictor/prefix_cache.py) and backward stops there.
    lora_layers: int | None = None
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    # Prompt truncation: the first `prompt_head` and last `prompt_tail` tokens.
    # The instruction that decides the answer length ("summarize the above",
    # "in 500 words") is usually at one end of a long prompt.
    prompt_head: int = 96
    prompt_tail: int = 32
    # "chat": the truncated prompt is wrapped in the backbone's chat template
    # up to the assistant turn's start, as the served chat model sees it; the
    # state there is where the model begins its answer (measured on ShareGPT
    # with frozen SmolLM2 features: a head on it beats the raw prompt's).
    prompt_format: Literal["raw", "chat"] = "raw"
    pooling: Literal["mean", "last", "mean+last"] = "mean"
    # Outputs of these decoder layers (counted from 1) are pooled and
    # concatenated; None = the final hidden state. Middle layers carry more of
    # the length signal than the last one (studies/predictor/probe.py). Each
    # must be at least depth - lora_layers: the prefix cache stands in for the
    # layers below.
    pool_layers: tuple[int, ...] | None = None
    # "log": regression on log(RL) with an L1 loss (its optimum is the median,
    # the MAE-optimal point). "bins": a distribution over 32-token bins trained
    # with cross-entropy; the point prediction is then decoded for the metric
    # (see `decode`), and the distribution gives quantiles for padding.
    head: Literal["log", "bins"] = "bins"
    head_hidden: int = 256
    # Independently initialised MLPs whose bin distributions are averaged: a
    # cheap ensemble (each is a few hundred K parameters on shared features).
    n_heads: int = Field(default=1, ge=1)
    head_dropout: float = Field(default=0.1, ge=0.0, lt=1.0)
    bin_width: int = DEFAULT_BIN_WIDTH
    max_len: int = 1024  # upper edge of the last bin / cap of predictions
    # Point estimate from the bin distribution: "median" minimizes MAE,
    # "window" picks the centre of the 100-token window with most mass
    # (maximizes Acc-50), "mean" is the expectation.
    decode: Literal["median", "window", "mean"] = "window"
    dtype: Literal["float32", "bfloat16"] = "float32"

    @field_validator("pool_layers")
    @classmethod
    def _pool_layers_positive(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is not None and (not v or min(v) < 1):
            raise ValueError("pool_layers: decoder layers are counted from 1")
        return v

    @property
    def pooled_width(self) -> int:
        """How many pooled vectors the head sees (per hidden size)."""
        n = 1 if self.pool_layers is None else len(self.pool_layers)
        return n * (2 if self.pooling == "mean+last" else 1)

    @property
    def max_prompt_tokens(self) -> int:
        return self.prompt_head + self.prompt_tail

    @property
    def n_bins(self) -> int:
        return (self.max_len + self.bin_width - 1) // self.bin_width


class TrainConfig(BaseModel):
    """Optimisation settings. EconoServe trained 3 epochs with LoRA (§2.3)."""

    model_config = ConfigDict(extra="forbid")

    epochs: float = 3.0
    max_train_samples: int | None = None
    batch_size: int = 16
    # EconoServe used lr 0.01 for OPT-13B LoRA; on a 135M backbone with a fresh
    # head that diverges, 1e-3 (head) / 3e-4 (LoRA) is stable.
    lr: float = 3e-4
    head_lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    seed: int = 0
    eval_every: int = 0  # steps; 0 = only at the end
    eval_samples: int = 600  # test subset used for the learning curve
    checkpoint_every: int = 100
    use_prefix_cache: bool = True
    max_steps: int | None = None
    # A slice of the training split, taken by prompt, held out and scored
    # instead of the test split (learning curve and final figures): variants
    # are then compared without looking at the test split. 0 = no slice.
    val_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    # Where the backbone and head run ("cpu", "cuda", "cuda:1"); it does not
    # change what the adapter means, so it is not part of `ModelConfig`.
    device: str = "cpu"

    @field_validator("device")
    @classmethod
    def _device_known(cls, v: str) -> str:
        kind, _, index = v.partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
            raise ValueError(f"device: {v!r} is not 'cpu', 'cuda' or 'cuda:<n>'")
        return v
