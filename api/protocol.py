"""OpenAI-compatible wire messages and our own engine-facing messages.

Requests are strict, as OpenAI's own API is: a field we implement is
validated to OpenAI's documented range; an OpenAI field (or a vLLM
extension) we do not implement is accepted only with the value that means
"off" and otherwise rejected with a 400 naming it (`api/unsupported.py`);
a field nobody defines is rejected as unrecognized.  Nothing that would
change the answer is silently ignored; the end-user identifiers `user` and
`safety_identifier` are accepted, and change nothing.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from api.batch import Metadata
from api.chat_messages import ChatMessage, ContentPart, one_ending, opens_answer
from api.structured import ResponseFormat, StructuredOutputs
from api.token_restrictions import TokenRestrictions
from api.tools import ToolChoice, ToolDefinition
from api.unsupported import IncludeObfuscation
from engine.sampling_params import StructuredOutput

# OpenAI's integer fields are 64-bit; the engine's seed stream and token
# arithmetic assume it (vLLM bounds `seed` the same way).
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_I32_MAX = 2**31 - 1


class _Strict(BaseModel):
    # Strict types as OpenAI's API: "5" is not an integer, true is not 1.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk carries the usage
    # so far.
    continuous_usage_stats: bool = False
    include_obfuscation: IncludeObfuscation = False


class _SamplingFields(TokenRestrictions):
    model: str | None = None
    max_tokens: int | None = Field(None, gt=0, le=_I32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    seed: int | None = Field(None, ge=_I64_MIN, le=_I64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    # Declared after `stream`: its validator reads it.
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # Token id (as a JSON string key) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions with vLLM's names and meanings.
    top_k: int = Field(-1, ge=-1, le=_I32_MAX)
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the
    # context holds with max_tokens).
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=_I32_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Tokens less likely than min_p times the likeliest are dropped.
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0, le=_I32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    # Lower runs first (vLLM's priority scheduling) under `fcfs`, `conserve`
    # and the MLFQ policies (`mlfq`, `mlfq-naive`, `fixed-priority`);
    # `econoserve` orders by deadline and does not read it.
    priority: int = Field(0, ge=-_I32_MAX, le=_I32_MAX)
    # Logprobs of every prompt token (vLLM's extension): 0..20 alternatives.
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # Batch (offline) or interactive (online) work; carried to the engine's
    # jobs (`policy: conserve` serves them differently).  OpenAI's
    # `service_tier: "flex"` (slower, for work that can wait) is offline.
    job_class: Literal["online", "offline"] = "online"
    # Seconds from arrival within which the request should complete (its
    # JCT SLO); `policy: econoserve` orders by the deadline it gives.
    # None: the policy's default (`econoserve.jct_slo_scale`).
    jct_slo_s: float | None = Field(None, gt=0.0, le=86400.0)
    # vLLM's extension: the prefix cache shares KV only between requests of
    # the same salt (a tenant's), so that none can time another's prompts.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # OpenAI's routing hint: requests with the same key go, load permitting,
    # to a replica that served the key (scheduler/placement.py).  It neither
    # shares nor separates cached KV (`cache_salt` does that).
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=1024)
    # Structured output (api/structured.py): OpenAI's field, or vLLM's.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: the prompt's and the answer's token ids beside the text (a
    # stream sends each chunk's new ids, the prompt's with the first chunk).
    return_token_ids: bool = False
    # vLLM's: logprobs name each token "token_id:<id>", whatever its text.
    return_tokens_as_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep_some(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be at least 1, or -1 for the model's context")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(not 0 <= t <= _I32_MAX for t in v):
            raise ValueError("stop_token_ids must be token ids (non-negative)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return None
        for key, bias in v.items():
            if not key.isdigit() or int(key) > _I32_MAX:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{key}] = {bias} is outside [-100, 100]")
        return v

    @field_validator("job_class", mode="before")
    @classmethod
    def _as_the_tier_says(cls, v: Any, info: ValidationInfo) -> Any:
        # Runs only where job_class is given: the default follows the tier
        # (`_flex_is_offline`).
        if info.data.get("service_tier") == "flex" and v != "offline":
            raise ValueError('service_tier "flex" is offline work: job_class must be '
                             '"offline" or absent')
        return v

    @model_validator(mode="after")
    def _flex_is_offline(self) -> "_SamplingFields":
        if self.service_tier == "flex":
            self.job_class = "offline"
        return self

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream", False):
            raise ValueError("only allowed when stream is true")
        return v

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, v: int | None, info: ValidationInfo) -> int | None:
        # As vLLM: they come with the whole response, not in a stream.
        if v is not None and info.data.get("stream", False):
            raise ValueError("not available when stream is true")
        return v

    def bias_by_id(self) -> dict[int, float]:
        return {int(k): b for k, b in (self.logit_bias or {}).items()}


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_SamplingFields):
    # A string or token ids, or a batch of either: each prompt gets `n`
    # choices, indexed prompt-major as OpenAI does.
    prompt: Prompt
    # OpenAI's and vLLM's default for completions; `null` asks for the rest
    # of the context, as chat's default does.
    max_tokens: int | None = Field(16, gt=0, le=_I32_MAX)
    echo: bool = False
    # OpenAI: the sampled token's logprob and up to 5 alternatives.
    logprobs: int | None = Field(None, ge=0, le=5)
    # Served only when it adds nothing to `n` (OpenAI: best_of >= n).
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if v is not None and v < n:
            raise ValueError(f"must be at least n ({n})")
        if v is not None and v != n and v != 1:
            raise ValueError("only best_of equal to n is served: ranking extra samples "
                             "server-side is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("not supported by this server (no insertion mode)")
        return v

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Prompt) -> Prompt:
        if isinstance(v, str) or (v and isinstance(v[0], int)):
            if len(v) == 0:
                raise ValueError("prompt must not be empty")
            return v
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        if any(len(p) == 0 for p in v):  # type: ignore[arg-type]
            raise ValueError("no prompt of a batch may be empty")
        return v

    def prompts(self) -> list[str] | list[list[int]]:
        """The batch of prompts (one element for a single prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return p  # type: ignore[return-value]


class Prediction(BaseModel):
    """OpenAI's `prediction`: `{"type": "content", "content": text or text parts}`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["content"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    served: ClassVar[frozenset[str]] = frozenset(
        {"store", "metadata", "add_generation_prompt", "continue_final_message", "prediction"})

    messages: list[ChatMessage] = Field(..., min_length=1)
    # vLLM's prefill: the prompt ends inside the final message, which the
    # answer continues (its end-of-turn is left out), instead of where a new
    # answer begins (api/chat_messages.py, `opens_answer`).
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    # Keep the answer for `GET /v1/chat/completions` (api/chat_store_route.py);
    # not kept by default, as with OpenAI.
    store: bool | None = None
    # Declared after `store`: its validator reads it.
    metadata: Metadata | None = Field(None, max_length=16)
    # Declared after max_tokens (in the base) and logprobs: validators read them.
    max_completion_tokens: int | None = Field(None, gt=0, le=_I32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's chat extension; only "off" is served.
    echo: bool | None = None
    # Tool calling (api/tools.py).
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's Predicted Outputs: text the answer is expected to repeat much
    # of, proposed as drafts for speculative decoding (scheduler/speculation.py).
    prediction: Prediction | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _one_ending(cls, v: bool, info: ValidationInfo) -> bool:
        # The base class declares add_generation_prompt first: it is in data.
        one_ending(v, info.data.get("add_generation_prompt"))
        return v

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, v: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if v is not None and other is not None and v != other:
            raise ValueError(f"conflicts with max_tokens={other}; send one of them")
        return v

    @field_validator("metadata")
    @classmethod
    def _kept_with_store(cls, v: dict[str, str] | None, info: ValidationInfo
                         ) -> dict[str, str] | None:
        if v and not info.data.get("store"):
            raise ValueError("is only kept with a stored completion: send store: true")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs", False):
            raise ValueError("requires logprobs to be true")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("not supported for chat completions (use /v1/completions)")
        return v

    @property
    def opens_answer(self) -> bool:
        return opens_answer(self.continue_final_message, self.add_generation_prompt)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token when logprobs are on (OpenAI: top_logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class PromptTokensDetails(BaseModel):
    # Prompt tokens whose KV the engine found in its prefix cache.
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


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
    # Seconds from the job's arrival here to that estimate landing (it is
    # asked for beside the job, never before it).
    prediction_delay: float | None = None
    # Prompt tokens whose KV was found in the prefix cache.
    cached_tokens: int = 0
    # With a `prediction`: its tokens proposed as drafts and accepted, and
    # proposed and refused (OpenAI's usage.completion_tokens_details).
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None


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
    # The id the Scheduler admitted the client request under: its prompts'
    # request ids differ when it has several (the replica reports it taken
    # in, scheduler/placement.py).  None: `request_id`.
    admission_id: str | None = None
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float = 0.0
    seed: int | None
    stop: list[str]
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int]
    ignore_eos: bool
    min_tokens: int
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = Field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = Field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The grammar the output must follow (structured output).
    structured: StructuredOutput | None = None
    # The LoRA adapter it runs with (`lora_adapters`); None: the base model.
    adapter: str | None = None
    # A runtime-loaded adapter's folder and load time (engine/lora_pool.py).
    adapter_path: str | None = None
    adapter_loaded_at: float | None = None
    # Predicted Outputs: the prediction's tokens, drafts for every choice.
    prediction_token_ids: list[int] | None = None
    n: int = 1
    # vLLM's meaning: lower runs first; 0 is the default.
    priority: int = 0
    job_class: Literal["online", "offline"] = "online"
    jct_slo_s: float | None = None
    cache_salt: str | None = None
    prompt_cache_key: str | None = None
    arrival_time: float
    # The client reads tokens as they come (`stream`); otherwise the engine
    # sends its output at most every `HOLD_UNSTREAMED_S`
    # (deployments/stream_pacing.py).
    streamed: bool = True
    # A streamed choice's tokens go out this many at a time (the server's
    # `stream_interval`), the first one and the last at once.
    stream_interval: int = Field(1, ge=1)
    # Resuming on this replica a request whose replica failed
    # (deployments/resume.py): per choice, the tokens the client already
    # has (the engine recomputes their KV and goes on from there), or None
    # for a choice that had finished.
    resume: list[list[int] | None] | None = None
    # Set by the engine replica that resumes it: per choice, how many of its
    # KV blocks the host tier holds from the failed replica's checkpoints
    # (`survival.checkpoint`), fetched instead of recomputed.
    resume_kv_blocks: list[int] | None = None

    @model_validator(mode="after")
    def _resume_per_choice(self) -> "GenerateRequest":
        if self.resume is not None and len(self.resume) != self.n:
            raise ValueError(f"resume lists {len(self.resume)} choices, the request {self.n}")
        if self.resume_kv_blocks is not None and (
                self.resume is None or len(self.resume_kv_blocks) != self.n):
            raise ValueError("resume_kv_blocks goes with resume, one count per choice")
        return self


class WireLogprob(BaseModel):
    """`scheduler.plan.TokenLogprob` on the wire."""

    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)
    rank: int | None = None


class GenerateDelta(BaseModel):
    """New output of one choice since the last delta it was sent: choice
    `index` of the call's prompt number `prompt`."""

    prompt: int = 0
    index: int = 0
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id that ended it, with "stop".
    stop_reason: str | int | None = None
    metrics: JobMetrics | None = None
    # One entry per token id, when the request asked for logprobs.
    logprobs: list[WireLogprob] | None = None
    # Once, with the choice's first token, when it asked for prompt logprobs.
    prompt_logprobs: list[WireLogprob | None] | None = None
