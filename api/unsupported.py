"""OpenAI fields (and vLLM extensions) this server does not implement.

Each is accepted only with a value that asks for nothing (its default, or
the value that means "off"), so a client that spells out defaults keeps
working; any other value is a 400 naming the field.  Serving the request
while ignoring it would hand the client something it did not ask for.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo, field_validator

# field -> the values that ask for nothing, and why anything else is refused
_OFF: dict[str, tuple[tuple[Any, ...], str]] = {
    # OpenAI's deprecated forms of `tools` / `tool_choice`, served on chat.
    "functions": ((None, []), "deprecated: send tools to /v1/chat/completions"),
    "function_call": ((None, "none"), "deprecated: send tool_choice with tools"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    # Served on chat (api/protocol.py, speculative decoding).
    "prediction": ((None,), "a chat request's field"),
    "web_search_options": ((None,), "web search is not supported"),
    "reasoning_effort": ((None,), "this model does not reason"),
    "verbosity": ((None,), "verbosity control is not supported"),
    "store": ((None, False), "completions are not stored"),
    "metadata": ((None,), "completions are not stored, so metadata has no use"),
    # "flex" is served: it is offline work (api/protocol.py, `job_class`).
    "service_tier": ((None, "auto", "default", "flex"), "tiers offered: auto, default, flex"),
    # vLLM extensions.
    "use_beam_search": ((None, False), "beam search is not supported"),
    "length_penalty": ((None, 1, 1.0), "length_penalty applies to beam search only"),
    "spaces_between_special_tokens": ((None, True), "not configurable"),
    # Served on chat (api/protocol.py); a prompt has no template to end.
    "add_generation_prompt": ((None, True), "a chat request's field"),
    "continue_final_message": ((None, False), "a chat request's field"),
    "chat_template": ((None,), "the model's own chat template is used"),
    "chat_template_kwargs": ((None, {}), "the chat template takes no arguments"),
    "guided_json": ((None,), "vLLM's older spelling: send structured_outputs.json"),
    "guided_regex": ((None,), "vLLM's older spelling: send structured_outputs.regex"),
    "guided_choice": ((None,), "vLLM's older spelling: send structured_outputs.choice"),
    "guided_grammar": ((None,), "vLLM's older spelling: send structured_outputs.grammar"),
    "request_id": ((None,), "request ids are assigned by the server"),
    "documents": ((None,), "documents are not supported"),
    "mm_processor_kwargs": ((None,), "this model reads text only"),
    "kv_transfer_params": ((None,), "KV transfer is not supported"),
    "vllm_xargs": ((None,), "not supported"),
    # OpenAI's retention of cached prompts: this server keeps a prompt's KV
    # in memory while its blocks are not needed ("in-memory" is the older
    # SDKs' spelling of "in_memory").
    "prompt_cache_retention": ((None, "in_memory", "in-memory"),
                               "prompts stay cached in memory only, no extended retention"),
    # Caching is by prefix, automatic (`mode: implicit`), with no breakpoints
    # or lifetimes to set.
    "prompt_cache_options": ((None, {}, {"mode": "implicit"}),
                             "prompts are cached by prefix automatically; no breakpoints or ttl"),
    "moderation": ((None,), "no moderation is run"),
}

UNSUPPORTED_FIELDS = frozenset(_OFF)


def refuse_unless_off(field: str, value: Any) -> Any:
    """`value` if it asks for nothing of `field` (one of `_OFF`), else the
    error that names why it is refused."""
    allowed, why = _OFF[field]
    if not _is_off(value, allowed):
        raise ValueError(f"not supported by this server ({why})")
    return value


def _not_obfuscated(value: bool) -> bool:
    if value:
        raise ValueError("not supported by this server (streams are not obfuscated)")
    return value


# OpenAI's `stream_options.include_obfuscation` (on by default there): random
# padding on each streamed event against size side channels, which this
# server does not add; false asks for what it does.
IncludeObfuscation = Annotated[bool, AfterValidator(_not_obfuscated)]


def _is_off(value: Any, allowed: tuple[Any, ...]) -> bool:
    # `True == 1` in Python: compare types too, so `use_beam_search: 1` is refused.
    return any(value == a and type(value) is type(a) for a in allowed if a is not None) \
        or value is None


class UnsupportedFields(BaseModel):
    """Base of the request models: declares every unsupported field, so an
    "on" value is a validation error at that field (400, `param` set)."""

    # Strict types as OpenAI's API: "5" is not an integer, true is not 1.
    model_config = ConfigDict(extra="forbid", strict=True)
    # Fields of the list that a request model serves after all (it declares
    # them again with their own types).
    served: ClassVar[frozenset[str]] = frozenset()

    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    spaces_between_special_tokens: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    request_id: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None
    # OpenAI's end-user identifier for abuse monitoring: accepted, not used.
    safety_identifier: str | None = None

    @field_validator(*_OFF, mode="before")
    @classmethod
    def _refuse_on(cls, v: Any, info: ValidationInfo) -> Any:
        if info.field_name in cls.served:
            return v
        return refuse_unless_off(info.field_name, v)  # type: ignore[arg-type]
