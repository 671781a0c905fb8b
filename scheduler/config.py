"""Configuration of the per-replica scheduling core."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str = "fcfs"
    block_size: int = Field(16, ge=1, le=1024)
    num_blocks: int = Field(..., ge=1)
    max_batch_size: int = Field(32, ge=1)
    # Token budget of one iteration: decodes count one each, prefill chunks
    # their length (chunked prefill, as in vLLM / Sarathi).
    max_batch_tokens: int = Field(512, ge=1)
    max_model_len: int = Field(2048, ge=2)

    @model_validator(mode="after")
    def _fits(self) -> "SchedulerConfig":
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"num_blocks * block_size = {self.num_blocks * self.block_size} tokens "
                f"cannot hold one sequence of max_model_len = {self.max_model_len}"
            )
        return self
