"""OpenAI-compatible wire messages (the subset we serve) and our own
engine-facing request/stream messages.

Unknown fields are ignored rather than rejected, as OpenAI-compatible
servers do, so clients that send newer parameters keep working.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingFields(_Lenient):
    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops


class CompletionRequest(_SamplingFields):
    # A string, or a list of token ids; batches of prompts (n>1) are not served.
    prompt: str | list[int]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | list[int]) -> str | list[int]:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class JobMetrics(BaseModel):
    """Our extension of a response: where the request's time went."""

    queue_time: float  # arrival to first scheduled iteration
    ttft: float
    e2e: float
    # Seconds of the iterations this job was part of (its attained service).
    execution_time: float
    # Seconds it waited for its KV to come back from the host tier.
    swap_wait_time: float
    num_preemptions: int
    # The predictor's response-length estimate, if it landed in time.
    predicted_output_len: int | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


# Engine-facing messages ---------------------------------------------------


class GenerateRequest(BaseModel):
    """What the ingress asks an engine replica to generate.

    `n` > 1 asks for that many independent choices of one prompt: the
    engine runs them as `n` jobs that share the prompt's KV blocks (one
    prefill), choice `i` seeded `seed + i` when a seed is given.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    min_tokens: int
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = Field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    # vLLM's meaning: lower runs first; 0 is the default.
    priority: int = 0
    job_class: Literal["online", "offline"] = "online"
    arrival_time: float
    # The client's end-user id (OpenAI `user`), for logs.
    user: str | None = None


class WireLogprob(BaseModel):
    """`scheduler.plan.TokenLogprob` on the wire."""

    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)


class GenerateDelta(BaseModel):
    """New output of one choice (`index`) since the last delta it was sent."""

    index: int = 0
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    metrics: JobMetrics | None = None
    # One entry per token id, when the request asked for logprobs.
    logprobs: list[WireLogprob] | None = None
    # Once, with the choice's first token, when it asked for prompt logprobs.
    prompt_logprobs: list[WireLogprob | None] | None = None
