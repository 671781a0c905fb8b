"""Per-request sampling parameters (OpenAI semantics), validated at ingress.

Kept free of torch so that the ingress can validate requests without
importing the engine's tensor code; `engine.sampling` re-exports it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StructuredOutput(BaseModel):
    """A grammar the output must follow (`engine/structured.py` masks every
    token outside it).  `json_object`: any JSON object; `json_schema`: JSON
    valid under `spec`, a JSON Schema as text; `regex`: text matching the
    regular expression `spec`; `choice`: exactly one of `choices`;
    `grammar`: the EBNF grammar `spec` (xgrammar's dialect, as vLLM's);
    `structural_tag`: xgrammar's structural tag `spec` as JSON text (tool
    calls, `api/tools.py`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json_object", "json_schema", "regex", "choice", "grammar", "structural_tag"]
    spec: str | None = None
    choices: tuple[str, ...] | None = None

    @model_validator(mode="after")
    def _has_spec(self) -> "StructuredOutput":
        if self.kind == "choice":
            if not self.choices:
                raise ValueError("a choice needs at least one string")
        elif self.kind != "json_object" and not self.spec:
            raise ValueError(f"{self.kind} needs a spec")
        return self


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # 0 means greedy; OpenAI's default is 1.
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # -1 or 0 turn top-k off.
    top_k: int = Field(-1, ge=-1)
    # vLLM's min_p: after temperature, a token whose probability is below
    # min_p times the likeliest token's is dropped.  0 = off.
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # With a seed, the k-th output token depends only on (seed, k) and the
    # logits, so a recomputation after preemption reproduces it.
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    # vLLM's: return the stop string that ended the text; keep special
    # tokens' text in the output.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] = Field(default_factory=list)
    # None: until EOS, a stop condition, or the model's max length.
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    # OpenAI's penalties on the generated tokens so far (vLLM's semantics):
    # logit -= frequency_penalty * count + presence_penalty * (count > 0).
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # CTRL / Hugging Face multiplicative penalty on every token seen in the
    # prompt or the output: positive logits divided by it, negative ones
    # multiplied.  1 = off.
    repetition_penalty: float = Field(1.0, gt=0.0)
    # Added to the logits of these token ids before sampling (OpenAI:
    # -100 bans a token, 100 forces it).
    logit_bias: dict[int, float] = Field(default_factory=dict)
    # vLLM's `allowed_token_ids`: only these may be sampled (None: any).
    allowed_token_ids: list[int] | None = None
    # vLLM's `bad_words` as the token sequences that spell them
    # (engine/bad_words.py): none may end the answer.
    bad_words_token_ids: list[list[int]] = Field(default_factory=list)
    # Return the sampled token's logprob and this many most likely
    # alternatives (0: only the sampled token's); None: no logprobs.
    logprobs: int | None = Field(None, ge=0)
    # The same for every prompt token (`echo` with `logprobs`); delivered
    # with the first sampled token.
    prompt_logprobs: int | None = Field(None, ge=0)
    # Constrained decoding: every sampled token keeps the output inside
    # this grammar.  Its end is a stop token, so EOS must stay a stop
    # (no `ignore_eos`) and be allowed at once (no `min_tokens`).
    structured: StructuredOutput | None = None
    # The LoRA adapter the request runs with (engine/lora.py), by the name
    # the runner loaded it under; None: the base model.
    adapter: str | None = None
    # A runtime adapter's folder and when it was loaded (engine/lora_pool.py):
    # the runner reads it from there on first use.  None: one of
    # `lora_adapters`, loaded at start.
    adapter_path: str | None = None
    adapter_loaded_at: float | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        # OpenAI accepts a single string or a list; None means no stops.
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_nonnegative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[int, float]) -> dict[int, float]:
        if any(t < 0 for t in v):
            raise ValueError("logit_bias keys must be non-negative token ids")
        if any(not -100.0 <= b <= 100.0 for b in v.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        return v

    @field_validator("allowed_token_ids")
    @classmethod
    def _some_allowed(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(t < 0 for t in v)):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        return v

    @field_validator("bad_words_token_ids")
    @classmethod
    def _spelt(cls, v: list[list[int]]) -> list[list[int]]:
        if any(not seq or any(t < 0 for t in seq) for seq in v):
            raise ValueError("bad_words_token_ids must be non-empty lists of token ids")
        return v

    @model_validator(mode="after")
    def _min_le_max(self) -> "SamplingParams":
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}"
            )
        return self

    @model_validator(mode="after")
    def _grammar_can_end(self) -> "SamplingParams":
        if self.structured is not None and (self.ignore_eos or self.min_tokens):
            raise ValueError("structured output ends at EOS: it cannot be combined with "
                             "ignore_eos or min_tokens")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def draftable(self) -> bool:
        """Speculative drafts can be verified for it (engine/speculative.py):
        not with logprobs (of accepted drafts) or a grammar (which would
        have to take the drafts in)."""
        return self.logprobs is None and self.structured is None

    @property
    def restricts_tokens(self) -> bool:
        """`allowed_token_ids` or `bad_words` change its logits."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    def named_token_ids(self) -> Iterator[int]:
        """The token ids its logit_bias, allowed_token_ids and bad words
        name."""
        yield from self.logit_bias
        yield from self.allowed_token_ids or ()
        for seq in self.bad_words_token_ids:
            yield from seq

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def reweights(self) -> bool:
        """Whether a logit bias, penalties or an allowed list change the
        logits (bans and a grammar come from the request's state)."""
        return bool(self.logit_bias or self.has_penalties or self.allowed_token_ids is not None)
